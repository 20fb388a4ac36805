"""The on-disk packed-weight cache (``kvserve.model.weight_cache``), the model-file hash memo, the GGUF
metadata cache and the lazily zeroed KV pool, on the real default model where it matters."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import torch

from benchmarks.accuracy import all_logits
from kvserve.model import weight_cache as wc
from kvserve.model.backends import select_backends
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model
from kvserve.layers.quant_linear import QuantLinear
from kvserve.quant.gguf_io import QuantTensor
from kvserve.worker.kv_pool import lazy_zeros

pytestmark = pytest.mark.real_model

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

    counted = dataclasses.replace(backends, make_linear=counting)

    def build():
        calls.clear()
        return cache.build_model(lambda b: LlamaModel(loaded.arch, loaded.weights, b), counted)

    return loaded, cache, build, calls


def _greedy(model, n=4):
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(all_logits(model, ids)[-1].argmax()))
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
    assert second.embed.head is second.lm_head.packed  # the embedding's rows come from the mapped entry too
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
    # A new code version: another file name, a miss; the entries of the KEEP_VERSIONS most recently used versions
    # stay (two checkouts on one machine do not repack at every start), older ones are deleted when one is written.
    paths = [path]
    for k, version in enumerate("abcd"):
        monkeypatch.setattr(wc, "code_version", lambda v=version: v * 16)
        assert cache.entry_path("auto") not in paths and cache.read("auto") is None
        cache.write("auto", entry)
        paths.append(cache.entry_path("auto"))
        for age, p in enumerate(reversed(paths)):  # distinct use times, the one just written newest
            if p.exists():
                os.utime(p, (1e9 - age, 1e9 - age))
    assert [p.exists() for p in paths] == [False, False, True, True, True] and wc.KEEP_VERSIONS == 3
    monkeypatch.setattr(wc, "code_version", lambda: "b" * 16)  # a read refreshes its entry's use time
    assert cache.read("auto") is not None and paths[2].stat().st_mtime > paths[4].stat().st_mtime


def test_source_hash_memo_follows_content(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 4096)
    st = f.stat()
    h1 = wc.source_sha256(f, root=tmp_path)
    assert h1 == wc.source_sha256(f, root=tmp_path) == __import__("hashlib").sha256(b"a" * 4096).hexdigest()
    f.write_bytes(b"b" * 4096)  # same size; mtime put back: only ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert wc.source_sha256(f, root=tmp_path) == __import__("hashlib").sha256(b"b" * 4096).hexdigest()


def _write_gguf(path, seed):
    """A tiny one-layer Llama GGUF written by ``gguf.GGUFWriter``: Q8_0, F16 and F32 tensors, a token list (an
    array field, left out of the metadata entry) and an EOS id."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 64),
                   (w.add_feed_forward_length, 96), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 5e5), (w.add_eos_token_id, 3)):
        add(v)
    w.add_token_list([f"t{i}" for i in range(40)])
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape, qtype in (("token_embd.weight", (40, 64), q8), ("blk.0.attn_q.weight", (64, 64), q8),
                               ("blk.0.attn_k.weight", (32, 64), q8), ("blk.0.ffn_down.weight", (64, 96), q8),
                               ("blk.0.attn_norm.weight", (64,), gguf.GGMLQuantizationType.F16),
                               ("output_norm.weight", (64,), gguf.GGMLQuantizationType.F32)):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == q8:
            w.add_tensor(name, gguf.quants.quantize(x, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, x.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_load(a, b):
    assert a.arch == b.arch and a.eos_token_ids == b.eos_token_ids == (3,) and a.weights.keys() == b.weights.keys()
    for k, x in a.weights.items():
        y = b.weights[k]
        if isinstance(x, QuantTensor):
            assert (x.qtype, x.shape) == (y.qtype, y.shape) and np.array_equal(x.raw, y.raw)
        else:
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_gguf_metadata_cache_miss_hit_corrupt_and_changed(tmp_path, monkeypatch, caplog):
    import gguf

    from kvserve.model.loader import _load_gguf
    from kvserve.quant import gguf_io

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, 0)
    reader = gguf.GGUFReader(str(path))
    source_hash = wc.source_sha256(path)
    entry = wc.gguf_metadata_path(source_hash)
    with caplog.at_level(logging.INFO, logger="kvserve.model.weight_cache"):
        miss = {q: _load_gguf(path, keep_quantized=q, with_tokenizer=False) for q in (True, False)}
    assert "with gguf.GGUFReader" in caplog.text and "(one-off)" in caplog.text and entry.exists()
    arch = miss[True].arch
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers) == (40, 64, 96, 1)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.max_position_embeddings) == (
        2, 1, 32, 128)
    assert (arch.rope_theta, arch.tie_word_embeddings) == (5e5, True)
    assert arch.rms_norm_eps == float(np.float32(1e-5))
    meta, tensors = wc.read_gguf_cached(path, source_hash)
    assert "tokenizer.ggml.tokens" not in meta["fields"] and meta["fields"]["tokenizer.ggml.eos_token_id"] == 3
    for t in reader.tensors:  # the tensor table's views hold exactly the library's bytes
        mine = tensors[t.name]
        if isinstance(mine, QuantTensor):
            assert mine.qtype == t.tensor_type and np.array_equal(mine.raw, t.data)
        else:
            assert np.array_equal(mine, np.asarray(t.data, np.float32).reshape(mine.shape))
    fp32 = miss[False].weights["model.layers.0.self_attn.q_proj.weight"]
    q = tensors["blk.0.attn_q.weight"]
    assert torch.equal(fp32, torch.from_numpy(q.take_rows(gguf_io.rope_unpermute_index(64, 2)).dequantize()))

    def no_reader(*a, **k):
        raise AssertionError("GGUFReader used on a hit")

    monkeypatch.setattr(gguf_io, "GGUFReader", no_reader)
    for q in (True, False):  # a hit: the JSON entry + a memory map, no GGUFReader
        _same_load(miss[q], _load_gguf(path, keep_quantized=q, with_tokenizer=False))
    monkeypatch.undo()
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))

    good = entry.read_bytes()
    head_count = good.replace(b'"llama.attention.head_count": 2', b'"llama.attention.head_count": 4')
    assert head_count != good
    e = json.loads(good)
    e["body"]["tensors"][0]["offset"] += path.stat().st_size  # a tensor table that does not fit the file...
    e["sha256"] = wc._body_sha256(e["body"])  # ...behind a valid checksum
    for damaged in (head_count, json.dumps(e).encode(), good[: len(good) // 2], b"", b"[]"):
        entry.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvserve.model.weight_cache"):
            _same_load(miss[True], _load_gguf(path, keep_quantized=True, with_tokenizer=False))
        assert "unusable" in caplog.text and "with gguf.GGUFReader" in caplog.text  # rebuilt, never used
        assert entry.read_bytes() == good

    old_embedding = np.array(miss[True].weights["model.embed_tokens.weight"].raw)  # (the map follows the file)
    _write_gguf(path, 1)  # new content: a new hash, a miss
    new_hash = wc.source_sha256(path)
    assert new_hash != source_hash and not wc.gguf_metadata_path(new_hash).exists()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.model.weight_cache"):
        changed = _load_gguf(path, keep_quantized=True, with_tokenizer=False)
    assert "with gguf.GGUFReader" in caplog.text and wc.gguf_metadata_path(new_hash).exists()
    assert changed.arch == arch
    new_reader = gguf.GGUFReader(str(path))
    emb = next(t for t in new_reader.tensors if t.name == "token_embd.weight")
    assert np.array_equal(changed.weights["model.embed_tokens.weight"].raw, emb.data)
    assert not np.array_equal(changed.weights["model.embed_tokens.weight"].raw, old_embedding)


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


def test_a_file_that_is_no_gguf_fails_before_the_first_run_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with caplog.at_level(logging.INFO, logger="kvserve.model.weight_cache"):
        with pytest.raises(ValueError, match=r"cannot read GGUF file '.*bad.gguf': GGUF magic invalid \(the file "
                                             r"starts with b'not ', not b'GGUF'\)"):
            wc.read_gguf_cached(bad, wc.source_sha256(bad))
    assert "first run" not in caplog.text and not wc.gguf_metadata_path(wc.source_sha256(bad)).exists()
