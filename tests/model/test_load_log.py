"""The load log says, per weight format, what it runs as (issue 40, items 1 and 5): the loader warns about every
format widened to float32 (a block format no kernel reads), and the packed-weight build names each kept format's
kernel path (F16 weights: kept in 16 bits) and whether it holds the file's values."""

import logging

import numpy as np
import pytest
import torch

import gguf
from kvserve.kernels import qgemm as kernels
from kvserve.layers.quant_linear import describe_weight_formats, make_linear_method, weight_formats
from kvserve.model.loader import load_model
from kvserve.quant import QuantTensor, formats
from kvserve.quant.kquantize import quantize_q6_k


def _write(path, rng):
    """A one-layer Llama GGUF: Q6_K q, Q2_K k and IQ4_XS v (random blocks: gguf cannot quantize them), F16 ffn_down,
    Q8_0 rest."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 256),
                   (w.add_feed_forward_length, 256), (w.add_head_count, 4), (w.add_head_count_kv, 4),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 1e4)):
        add(v)
    w.add_token_list([f"t{i}" for i in range(64)])
    q8, q2 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q2_K
    x = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05  # noqa: E731
    w.add_tensor("token_embd.weight", gguf.quants.quantize(x(64, 256), q8), raw_dtype=q8)
    w.add_tensor("blk.0.attn_q.weight", quantize_q6_k(x(256, 256)), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    bs, tb = formats.block_size(q2)
    k2 = rng.integers(0, 256, (256, 256 // bs, tb), dtype=np.uint8)
    k2[..., 80:84] = np.tile((rng.random((256, 1, 2)) * 0.01).astype("<f2").view(np.uint8), (1, 1, 1))
    w.add_tensor("blk.0.attn_k.weight", k2.reshape(256, -1), raw_dtype=q2)
    iq4, (bs, tb) = gguf.GGMLQuantizationType.IQ4_XS, formats.block_size(gguf.GGMLQuantizationType.IQ4_XS)
    v4 = rng.integers(0, 256, (256, 256 // bs, tb), dtype=np.uint8)
    v4[..., 0:2] = (rng.random((256, 1, 1)) * 0.01).astype("<f2").view(np.uint8)
    w.add_tensor("blk.0.attn_v.weight", v4.reshape(256, -1), raw_dtype=iq4)
    for name in ("attn_output", "ffn_gate", "ffn_up"):
        w.add_tensor(f"blk.0.{name}.weight", gguf.quants.quantize(x(256, 256), q8), raw_dtype=q8)
    w.add_tensor("blk.0.ffn_down.weight", x(256, 256).astype(np.float16))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_loader_names_every_format_widened_to_float32(tmp_path, caplog):
    path = tmp_path / "mixed.gguf"
    _write(path, np.random.default_rng(0))
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        loaded = load_model(str(path), keep_quantized=True, weights_only=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dequantized to float32 (4 bytes a weight): IQ4_XS x 1 --" in m for m in warned), warned
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].qtype == formats.Q6_K  # kept
    assert loaded.weights["model.layers.0.self_attn.k_proj.weight"].qtype == formats.Q2_K  # kept (FMT_Q2K)
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].qtype == formats.F16  # kept in 16 bits
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        fp32 = load_model(str(path), keep_quantized=False, weights_only=True)
    assert fp32.weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert any("F16 x 1, IQ4_XS x 1, Q2_K x 1, Q6_K x 1, Q8_0 x 4 (quantization fp32)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.skipif(kernels.isa() is None, reason=str(kernels.unavailable_reason()))
def test_weight_formats_line_names_paths_and_exactness():
    rng = np.random.default_rng(1)
    q6 = QuantTensor("a", formats.Q6_K, quantize_q6_k(rng.standard_normal((32, 256)).astype(np.float32)), (32, 256))
    q8 = QuantTensor("b", formats.Q8_0, gguf.quants.quantize(rng.standard_normal((16, 256)).astype(np.float32),
                                                             formats.Q8_0), (16, 256))
    f16 = QuantTensor("c", formats.F16, rng.standard_normal((16, 256)).astype(np.float16).view(np.uint8), (16, 256))
    mixed = [q6, q8, f16]
    records = weight_formats(mixed, make_linear_method(mixed))  # a ConcatLinear: each part its own path
    records += weight_formats([q6], make_linear_method([q6], "int8"))
    path = kernels.default_path()
    suffix = f"{path.isa}{'+a16' if path.activations == 'int8x2' else ''}"
    assert describe_weight_formats(records) == (
        "F16: 1 tensor on f16/kvserve (exact); "
        f"Q6_K: 1 tensor on int8/{suffix} (re-quantized to int8 per 32 weights, not the file's values); "
        f"Q6_K: 1 tensor on q6_k/{suffix} (exact); Q8_0: 1 tensor on q8/{suffix} (exact)")


@pytest.mark.skipif(kernels.isa() is None, reason=str(kernels.unavailable_reason()))
def test_q3_k_and_mxfp4_are_named_with_their_kernels():
    """Q3_K and MXFP4 are kept (no float32 widening) and the load log names what they run as: q3_k (its Q3K
    layout on the Q6 tiles) and mxfp4, both exact."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (16, 110), dtype=np.uint8)
    raw[:, 108:110] = (rng.random((16, 1)) * 0.01).astype("<f2").view(np.uint8)
    q3 = QuantTensor("a", formats.Q3_K, raw, (16, 256))
    mx = QuantTensor("b", formats.MXFP4, gguf.quants.quantize(rng.standard_normal((16, 256)).astype(np.float32) * 0.1,
                                                               formats.MXFP4), (16, 256))
    records = weight_formats([q3, mx], make_linear_method([q3, mx]))
    path = kernels.default_path()
    suffix = f"{path.isa}{'+a16' if path.activations == 'int8x2' else ''}"
    assert describe_weight_formats(records) == (f"MXFP4: 1 tensor on mxfp4/{suffix} (exact); "
                                                f"Q3_K: 1 tensor on q3_k/{suffix} (exact)")
