"""A decoder layer described once (issue 49, kvserve/model/layer_spec.py): every family's ``DecoderSpec`` says what
its layers do; the fused C loop (csrc/decoder.c) runs every family kvserve loads -- windows, soft-caps, per-head and
whole-projection Q/K norms, post-norms, Gemma's four norms and ``1 + w`` scales, GELU, Granite's scalars, NoPE
layers, per-layer RoPE tables, o_proj and MLP biases -- and gives the Python loop's logits and KV cache bit for bit
on a step mixing a prompt longer than the windows, a chunk over cached context and decode rows; bad specs are
refused by name."""

import pytest
import torch

from kvserve.kernels import qgemm as qkernels
from kvserve.model.backends import select_backends
from kvserve.model.fused_layers import FusedLayerLoop
from kvserve.model.layer_spec import DecoderSpec, LayerSpec, RopeSpec
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from tests.conftest import flat_batch, scattered_block_tables
from tests.model.test_families import _tiny
from tests.model.test_families_gemma import _gemma
from tests.model.test_families_phi3_olmo2 import _randomize

pytestmark = pytest.mark.real_model  # the real model's tokenizer


def _checkpoint(kind, factory, tokenizer):
    """A tiny random checkpoint of each kind of layer the spec describes."""
    if kind == "qwen3-window":  # per-head Q/K norms; windows on the layers from max_window_layers on
        return _randomize(*_tiny(factory, tokenizer, kind, cls="Qwen3", head_dim=32, use_sliding_window=True,
                                 sliding_window=8, max_window_layers=1))
    if kind == "gemma2":  # four (1 + w) norms, GELU, window 8 on every other layer, soft-caps
        return _gemma(factory, tokenizer, kind, "Gemma2", 4, sliding_window=8, attn_logit_softcapping=50.0)
    if kind == "gemma3":  # + per-head Q/K norms (one KV head, as Gemma 3 1B), local and global RoPE tables
        return _gemma(factory, tokenizer, kind, "Gemma3", 6, hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=12,
                      rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    if kind == "olmo2":  # post-norms only, whole-projection Q/K norms, o_proj biases
        return _randomize(*_tiny(factory, tokenizer, kind, cls="Olmo2", pad_token_id=0, attention_bias=True))
    if kind == "granite":  # the four scalars
        return _tiny(factory, tokenizer, kind, cls="Granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.0078125, logits_scaling=8.0)
    if kind == "smollm3":  # a NoPE layer
        return _tiny(factory, tokenizer, kind, cls="SmolLM3", no_rope_layers=[1, 0], pad_token_id=0)
    if kind == "llama-biases-gelu":  # every projection biased, a GELU-gated MLP
        return _tiny(factory, tokenizer, kind, bias=True, attention_bias=True, mlp_bias=True,
                     hidden_act="gelu_pytorch_tanh")
    if kind == "phi3-window":  # fused qkv / gate_up, a window on every layer
        return _randomize(*_tiny(factory, tokenizer, kind, cls="Phi3", pad_token_id=0, sliding_window=5))
    raise AssertionError(kind)


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.dtype.itemsize])


@pytest.mark.skipif(qkernels.load() is None or qkernels.isa() is None, reason="quantized kernels unavailable")
@pytest.mark.parametrize("kind", ["qwen3-window", "gemma2", "gemma3", "olmo2", "granite", "smollm3",
                                  "llama-biases-gelu", "phi3-window"])
def test_the_c_loop_runs_every_family_with_the_python_loops_bits(tmp_path_factory, tokenizer, kind):
    path, _ = _checkpoint(kind, tmp_path_factory, tokenizer)
    model = build_model(load_model(str(path), weights_only=True), select_backends("cpu", torch.float32, "int8"))
    assert isinstance(model.fused_layers, FusedLayerLoop), kind
    lf, cf, lp, cp = _both_loops(model)
    assert torch.equal(_bits(lf), _bits(lp)) and torch.equal(_bits(cf), _bits(cp)), kind


def _both_loops(model):
    """``(logits, cache)`` of the C loop, then of the Python loop, on the same step: a 20-token prompt (longer than
    every window), 6 new tokens over 17 cached ones, two decode rows (the cached context: the same random values
    for both runs)."""
    shape = [(0, 20), (17, 6), (40, 1), (9, 1)]
    tables = scattered_block_tables(shape, 4)
    reqs = [([(7 * i + 3 * j) % 30000 + 100 for j in range(q)], ctx, t) for i, ((ctx, q), t) in
            enumerate(zip(shape, tables))]
    batch = flat_batch(reqs, 4, logits_rows=range(sum(q for _, q in shape)))
    out, loop = [], model.fused_layers
    for fused in (loop, None):
        model.fused_layers = fused
        cache = torch.zeros(model.kv_cache_shape(64, 4))
        # the cached context: the same values for both runs (the loops must agree on the new rows)
        torch.manual_seed(1)
        cache.normal_()
        out.append((model.forward(batch, cache), cache))
    model.fused_layers = loop
    (lf, cf), (lp, cp) = out
    return lf, cf, lp, cp


@pytest.mark.skipif(qkernels.load() is None or qkernels.isa() is None, reason="quantized kernels unavailable")
def test_a_qkv_projection_mixing_formats_runs_in_the_c_loop(tmp_path, tmp_path_factory, tokenizer):
    """Q/K/V in different formats (a Q4_K_M file's Q6_K ``attn_v`` beside Q4_K ``attn_q`` / ``attn_k``; here Q5_0
    beside Q8_0): no one packed weight holds them (``ConcatLinear``), so the C loop runs each part's matmul into
    its columns of the Q/K/V rows (``DecoderLayer.qkv_rest``) -- the Python loop's logits and KV cache bit for bit."""
    from kvserve.layers.quant_linear import ConcatLinear
    from tests.model.test_families import _write_gguf

    _, hf = _tiny(tmp_path_factory, tokenizer, "mixed-qkv")
    names = [f"blk.{i}.{k}.weight" for i in range(2)
             for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    v = [f"blk.{i}.attn_v.weight" for i in range(2)]
    path = _write_gguf(tmp_path / "mixed.gguf", hf, "llama", True, q5_0=v, q8_0=names)
    model = build_model(load_model(str(path), keep_quantized=True, weights_only=True),
                        select_backends("cpu", torch.float32, "auto"))
    assert all(isinstance(w["qkv"], ConcatLinear) for w in model.layers)
    assert isinstance(model.fused_layers, FusedLayerLoop)
    lf, cf, lp, cp = _both_loops(model)
    assert torch.equal(_bits(lf), _bits(lp)) and torch.equal(_bits(cf), _bits(cp))


def test_specs_are_checked_by_name():
    with pytest.raises(ValueError, match=r"LayerSpec.norms must be one of \('pre', 'post', 'both'\), got 'mid'"):
        LayerSpec(norms="mid")
    with pytest.raises(ValueError, match=r"LayerSpec.qk_norm must be one of"):
        LayerSpec(qk_norm="rms")
    with pytest.raises(ValueError, match=r"LayerSpec.window must be a positive number of tokens or None, got 0"):
        LayerSpec(window=0)
    with pytest.raises(ValueError, match=r"layers \[1\] name a RoPE table outside the 1 of the spec"):
        DecoderSpec(layers=(LayerSpec(), LayerSpec(rope=1)), ropes=(RopeSpec(1e4),))
    with pytest.raises(ValueError, match=r"layers \[0\] have a mixture-of-experts MLP but the spec has no router"):
        DecoderSpec(layers=(LayerSpec(mlp="moe"),), ropes=(RopeSpec(1e4),))
    spec = DecoderSpec(layers=(LayerSpec(), LayerSpec(rope=None)), ropes=(RopeSpec(1e4),))
    assert spec.first(1).layers == (LayerSpec(),)
