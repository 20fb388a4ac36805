"""The on-disk packed-weight cache (``kvserve.model.weight_cache``), the model-file hash memo, the struct-based GGUF
parser and the lazily zeroed KV pool, on the real default model where it matters."""

import logging
import os

import numpy as np
import pytest
import torch

from kvserve.bench.accuracy import _all_logits
from kvserve.model import weight_cache as wc
from kvserve.model.backends import select_backends
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model
from kvserve.model.quant import QuantLinear
from kvserve.model.quant.gguf_io import GGUFFile
from kvserve.worker.kv_pool import lazy_zeros

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]  # any ids: the test compares two loads


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    loaded = load_model(None, "float32", keep_quantized=True)
    backends = select_backends("cpu", torch.float32, "auto")
    cache = wc.WeightCache(loaded.path, loaded.weight_cache.source_hash, root=tmp_path_factory.mktemp("kvcache"))
    calls = []

    def counting(parts):
        calls.append(len(parts))
        return backends.make_linear(parts)

    counted = type(backends)(backends.device, backends.attention, backends.ops, counting, backends.quantization)

    def build():
        calls.clear()
        return cache.build_model(lambda b: LlamaModel(loaded.arch, loaded.weights, b), counted)

    return loaded, cache, build, calls


def _greedy(model, n=4):
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(_all_logits(model, ids)[-1].argmax()))
    return ids[len(PROMPT):]


def _packed(model):
    return [p.packed.data for layer in model.layers for p in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]


def _mapped_file(ptr: int) -> str:
    """The file whose mapping holds address ``ptr`` in this process (``/proc/self/maps``), or ``""``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


def test_miss_then_hit_same_tokens_without_packing(setup, caplog):
    loaded, cache, build, calls = setup
    path = cache.entry_path("auto")
    with caplog.at_level(logging.INFO, logger="kvserve.model.weight_cache"):
        first = build()  # uncached: every projection decoded and packed by the backends
    assert f"first run: packing weights into {path} (one-off)" in caplog.text
    assert path.exists() and len(calls) == 4 * loaded.arch.num_hidden_layers + 1  # 4 projections a layer + LM head
    second = build()
    assert calls == []  # every projection came from the file...
    assert all(_mapped_file(t.data_ptr()) == str(path) for t in _packed(second))  # ...memory-mapped, not copied
    for a, b in zip(_packed(first), _packed(second)):
        assert torch.equal(a, b)
    assert isinstance(second.lm_head, QuantLinear) and second.lm_head.path == first.lm_head.path
    assert _greedy(second) == _greedy(first)


def test_corrupt_entries_are_rebuilt(setup):
    _, cache, build, calls = setup
    path = cache.entry_path("auto")
    if not path.exists():
        build()
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) - 1000] ^= 0x01  # one bit of the payload
    for damaged in (bytes(flipped), good[: len(good) // 2], good[:10], b""):
        path.write_bytes(damaged)
        assert cache.read("auto") is None  # never used
    build()
    assert calls  # rebuilt...
    assert path.read_bytes() == good  # ...whole, the same bytes
    build()
    assert calls == []


def test_stale_entries_are_rebuilt(setup, monkeypatch):
    loaded, cache, build, calls = setup
    build()
    path = cache.entry_path("auto")
    entry = cache.read("auto")
    # Another model whose hash shares the file name's 16 hex digits: the header's full hash does not match.
    other = wc.WeightCache(loaded.path, cache.source_hash[:16] + "0" * 48, root=cache.root)
    other.write("auto", {"x": entry["token_embd.weight"]})
    assert other.entry_path("auto") == path and cache.read("auto") is None
    cache.write("auto", entry)
    # A new code version: another file name, a miss; writing it deletes the old version's file.
    monkeypatch.setattr(wc, "code_version", lambda: "f" * 16)
    assert cache.entry_path("auto") != path and cache.read("auto") is None
    cache.write("auto", entry)
    assert not path.exists() and cache.read("auto") is not None


def test_source_hash_memo_follows_content(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 4096)
    st = f.stat()
    h1 = wc.source_sha256(f, root=tmp_path)
    assert h1 == wc.source_sha256(f, root=tmp_path) == __import__("hashlib").sha256(b"a" * 4096).hexdigest()
    f.write_bytes(b"b" * 4096)  # same size; mtime put back: only ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert wc.source_sha256(f, root=tmp_path) == __import__("hashlib").sha256(b"b" * 4096).hexdigest()


def test_gguf_parser_reads_fields_and_tensors(tmp_path):
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "bc", ""])
    w.add_array("t.ints", [1, -2, 3])
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    q = np.random.default_rng(0).integers(0, 256, (2, 34), dtype=np.uint8)  # 2 rows of one Q8_0 block
    w.add_tensor("a", a)
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert (f.field("general.architecture"), f.field("t.u32"), f.field("t.f32"), f.field("t.bool")) == (
        "llama", 7, 0.5, True)
    assert f.field("t.str") == "héllo" and f.field("t.strs") == ["a", "bc", ""]
    assert f.field("t.ints").tolist() == [1, -2, 3] and f.field("missing", 3) == 3
    ta, tq = f.tensors
    assert (ta.name, ta.shape, tq.name, tq.shape) == ("a", (3, 4), "q", (2, 32))
    assert np.array_equal(f.tensor(ta), a)
    assert np.array_equal(f.tensor(tq).raw, q)
    path.write_bytes(path.read_bytes()[: f.data_offset + 20])  # data cut short
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(path)


def _vm_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_kv_pool_is_zero_and_not_resident_until_written():
    before = _vm_rss_kib()
    pool = lazy_zeros((8, 2, 1024, 16, 16, 64), torch.float32)  # 1 GiB
    assert pool.numel() * 4 == 2**30
    assert _vm_rss_kib() - before < 8 * 1024
    pool[0, 0, 0] = 1.0  # one block of one layer's keys (64 KiB)
    assert float(pool[0, 0, 1].abs().max()) == 0.0 and float(pool[0, 0, 0].min()) == 1.0
    assert _vm_rss_kib() - before < 8 * 1024
    assert lazy_zeros((0, 3), torch.float32).shape == (0, 3)
    with pytest.raises(ValueError, match="shape"):
        lazy_zeros((-1, 3), torch.float32)
