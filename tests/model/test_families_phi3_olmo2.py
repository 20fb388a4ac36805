"""Phi-3 (LongRoPE, partial rotary, fused ``qkv_proj`` / ``gate_up_proj``), OLMo 2 (post-norms, whole-projection
Q/K norms), dynamic NTK, GGUF YaRN and mixture-of-experts refusals (issue 40): tiny random checkpoints written by
``transformers`` from a config (norms and biases random, not 1 and 0) give ``transformers``' 32 greedy tokens and
prompt logprobs (within 1e-4) on the float32 path; the same weights written as a GGUF with llama.cpp's names
(F32, and Q8_0 on both paths) give the same tokens; every refused field gives its exact error."""

import json

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from tests.conftest import assert_greedy_matches_transformers, flat_batch
from tests.model.test_families import (PROMPTS, _GGUF_TOP, _check_parity, _logits, _permute, _tiny, gguf_writer,
                                       qk_norms)

pytestmark = pytest.mark.real_model  # the real model's tokenizer

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]  # 6 = 12 rotated features / 2 (head 16, partial_rotary_factor 0.75)
LONG = [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
OLMO2_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _randomize(path, hf):
    """Norm weights drawn in [0.5, 2] and biases from N(0, 0.5), saved over the checkpoint."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 2.0)
            elif n.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(str(path), safe_serialization=True)
    return path, hf


def _engine_matches(path, hf, tokenizer, **kw):
    """32 greedy tokens per prompt equal ``transformers``', and every prompt logprob within 1e-4 (float32 path)."""
    llm = LLM(model=str(path), num_kv_blocks=64, quantization="fp32", **kw)
    assert_greedy_matches_transformers(llm, hf, tokenizer, PROMPTS, max_tokens=32)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for pos, (entry, token) in enumerate(zip(out.prompt_logprobs[1:], ids[1:])):
            assert token in entry
            assert max(abs(lp - float(ref[pos, t])) for t, lp in entry.items()) < 1e-4, (prompt, pos)
    return llm


def _greedy(model, ids, n=32):
    """``n`` greedy tokens of a built model: the prompt in one step, then one token a step (paged KV cache)."""
    kv = torch.zeros(model.kv_cache_shape(64, 4))
    table = list(range(63, 63 - (len(ids) + n + 3) // 4, -1))
    logits, out = model.forward(flat_batch([(ids, 0, table)], 4), kv), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(flat_batch([([out[-1]], len(ids) + len(out) - 1, table)], 4), kv)
    return out


def _hf_greedy(hf, ids, n=32):
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


def _write_gguf(path, hf, arch, names, fields=(), tensors=(), q8_0=False, permute=False):
    """``hf``'s weights as a GGUF of ``arch`` (llama.cpp tensor ``names``; 2-D weights as Q8_0 blocks with
    ``q8_0``; Q/K rows in llama.cpp's order with ``permute``), plus metadata ``fields`` ``[(key, value)]`` (str,
    float or int) and ``tensors`` ``[(name, array)]``."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c, arch)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    for key, value in fields:
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
            key, value)
    for name, t in hf.state_dict().items():
        x, g = t.float().numpy(), _GGUF_TOP.get(name)
        if g is None:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            g = f"blk.{layer}.{names[module]}.{suffix}"
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                x = _permute(x, c.num_attention_heads if "q_proj" in module else c.num_key_value_heads)
        if q8_0 and x.ndim == 2:
            w.add_tensor(g, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, np.ascontiguousarray(x))
    for name, x in tensors:
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _q8_0_reference(hf):
    """A copy of ``hf`` whose 2-D weights are their Q8_0 round trip: the weights a Q8_0 GGUF of it holds."""
    import copy

    import gguf

    ref, q8 = copy.deepcopy(hf), gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 2:
                x = p.float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8).reshape(x.shape)))
    return ref


def _fp32(path, **kw):
    return build_model(load_model(str(path), weights_only=True), select_backends("cpu", torch.float32, "fp32"), **kw)


# ------------------------------------------------------------------------------------------------------------ Phi-3


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokenizer):
    """Phi-4-mini style: LongRoPE with the long factors in use (the prompts pass original_max_position_embeddings
    16 in transformers; max_model_len 512 > 16 in kvserve) and partial rotary 0.75."""
    return _randomize(*_tiny(tmp_path_factory, tokenizer, "phi3", cls="Phi3", pad_token_id=0, sliding_window=None,
                             original_max_position_embeddings=16, partial_rotary_factor=0.75,
                             rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}))


def test_phi3_longrope_partial_rotary_matches_transformers(phi3, tokenizer):
    path, hf = phi3
    arch = load_model(str(path)).arch
    s = arch.rope_scaling
    assert (s.rope_type, s.partial_rotary_factor, s.factor, s.uses_long_factor()) == ("longrope", 0.75, 32.0, True)
    _check_parity(path, hf, tokenizer)
    _engine_matches(path, hf, tokenizer)


def test_phi3_short_factors_when_max_model_len_is_within_the_original_context(tmp_path_factory, tokenizer):
    """A 4096-token model pretrained on 512: served at max_model_len 512 every sequence uses the short factors
    (as transformers does below 512 tokens), with the attention factor of 4096 / 512."""
    path, hf = _randomize(*_tiny(tmp_path_factory, tokenizer, "phi3s", cls="Phi3", pad_token_id=0,
                                 sliding_window=None, original_max_position_embeddings=512, head_dim=16,
                                 rope_scaling={"rope_type": "longrope", "short_factor": SHORT + [3.0, 4.0],
                                               "long_factor": LONG + [9.0, 10.0]}))
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(cfg))
    hf.config.max_position_embeddings = 4096  # the attention factor transformers computes from it
    hf.model.rotary_emb.__init__(hf.config)
    llm = _engine_matches(path, hf, tokenizer, max_model_len=512)
    assert not llm.llm_engine.model.arch.rope_scaling.uses_long_factor()
    assert _fp32(path).arch.rope_scaling.uses_long_factor()  # default max_model_len 4096: the long factors


@pytest.mark.parametrize("q8_0", [False, True], ids=["F32", "Q8_0"])
def test_phi3_gguf_gives_the_same_tokens(tmp_path, phi3, tokenizer, q8_0):
    _, hf = phi3
    fields = [("phi3.rope.scaling.original_context_length", 16), ("phi3.rope.dimension_count", 12),
              ("phi3.rope.scaling.attn_factor", float(np.sqrt(1 + np.log(32.0) / np.log(16)))),
              ("phi3.attention.sliding_window", 0)]
    path = _write_gguf(tmp_path / "phi3.gguf", hf, "phi3", PHI3_NAMES, fields,
                       [("rope_factors_long.weight", LONG), ("rope_factors_short.weight", SHORT)], q8_0=q8_0)
    loaded = load_model(str(path), weights_only=True)
    assert loaded.arch.rope_scaling.long_factor == tuple(LONG) and loaded.arch.rope_scaling.partial_rotary_factor == 0.75
    model, ref = _fp32(path), _q8_0_reference(hf) if q8_0 else hf
    _check_parity(path, ref, tokenizer, loaded)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids) == _hf_greedy(ref, ids), prompt
    if q8_0:  # the default quantized path runs the Q8_0 blocks on its kernels
        quant = build_model(load_model(str(path), keep_quantized=True, weights_only=True),
                            select_backends("cpu", torch.float32, "auto"))
        ids = tokenizer.encode(PROMPTS[0])
        assert (_logits(quant, ids) - _logits(model, ids)).abs().max().item() < 0.05
        assert len(_greedy(quant, ids)) == 32
        if quant.fused_layers is not None:  # the C layer loop takes partial rotary + LongRoPE: the Python loop's bits
            fused = _logits(quant, ids)
            quant.fused_layers = None
            assert torch.equal(fused, _logits(quant, ids))


# ------------------------------------------------------------------------------------------------------------ OLMo 2


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory, tokenizer):
    return _randomize(*_tiny(tmp_path_factory, tokenizer, "olmo2", cls="Olmo2", pad_token_id=0, attention_bias=True,
                             rope_theta=10000.0))


def test_olmo2_matches_transformers(olmo2, tokenizer):
    path, hf = olmo2
    assert _check_parity(path, hf, tokenizer).fused_layers is None
    _engine_matches(path, hf, tokenizer)


@pytest.mark.parametrize("q8_0", [False, True], ids=["F32", "Q8_0"])
def test_olmo2_gguf_gives_the_same_tokens(tmp_path, olmo2, tokenizer, q8_0):
    _, hf = olmo2
    path = _write_gguf(tmp_path / "olmo2.gguf", hf, "olmo2", OLMO2_NAMES, q8_0=q8_0)
    loaded = load_model(str(path), weights_only=True)
    assert loaded.arch.architecture == "Olmo2ForCausalLM" and qk_norms(loaded.arch) == {"proj"}
    model, ref = _fp32(path), _q8_0_reference(hf) if q8_0 else hf
    _check_parity(path, ref, tokenizer, loaded)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids) == _hf_greedy(ref, ids), prompt


# ------------------------------------------------------------------------------------------------------------- RoPE


def test_dynamic_ntk_is_fixed_for_max_model_len(tmp_path_factory, tokenizer):
    """transformers stretches the base for each forward's length past max_position_embeddings (16 here); kvserve
    fixes it for max_model_len: equal to transformers on a sequence of exactly that length, and plain RoPE (as
    transformers on any sequence) when max_model_len <= max_position_embeddings."""
    path, hf = _tiny(tmp_path_factory, tokenizer, "dynamic", rope_theta=10000.0,
                     rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(cfg))
    hf.config.max_position_embeddings = 16
    hf.model.rotary_emb.__init__(hf.config)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (_logits(_fp32(path, max_model_len=len(ids)), ids) - ref).abs().max().item() < 1e-4
        assert (_logits(_fp32(path, max_model_len=16), ids) - ref).abs().max().item() > 2e-4  # plain RoPE fails
    short = tokenizer.encode("Hello there")
    with torch.no_grad():
        assert (_logits(_fp32(path), short) - hf(torch.tensor([short])).logits[0]).abs().max().item() < 1e-4


def test_a_yarn_gguf_matches_transformers(tmp_path_factory, tmp_path, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "yarn", rope_theta=500000.0,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    fields = [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0),
              ("llama.rope.scaling.original_context_length", 32)]
    gguf_path = _write_gguf(tmp_path / "yarn.gguf", hf, "llama", LLAMA_NAMES, fields, permute=True)
    loaded = load_model(str(gguf_path), weights_only=True)
    s = loaded.arch.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32)
    _check_parity(gguf_path, hf, tokenizer, loaded)


# ------------------------------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer):
    return _tiny(tmp_path_factory, tokenizer, "llama", rope_theta=10000.0)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["rope_parameters"].pop("original_max_position_embeddings") and c.pop(
        "original_max_position_embeddings"),
     r"rope_parameters of rope_type 'longrope' in .* lacks original_max_position_embeddings"),
    (lambda c: c["rope_parameters"].pop("long_factor"), r"rope_parameters of rope_type 'longrope' in .* lacks "
                                                       r"\['long_factor'\]"),
    (lambda c: c["rope_parameters"].update(beta_fast=32), r"unsupported rope_parameters key\(s\) \['beta_fast'\] for "
                                                          r"rope_type 'longrope'"),
    (lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]),
     r"unsupported architecture 'DeepseekV3ForCausalLM' in .*: this mixture-of-experts model is not supported"),
    (lambda c: c.update(architectures=["PhimoeForCausalLM"]), r"'PhimoeForCausalLM' .* mixture-of-experts"),
], ids=["longrope-no-original", "longrope-no-long", "longrope-key", "deepseek-v3", "phimoe"])
def test_phi3_fields_and_moe_architectures_are_refused(tmp_path, phi3, edit, message):
    import shutil

    for f in phi3[0].iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        _fp32(tmp_path)


def test_phi3_with_a_window_covering_its_context_loads(tmp_path, phi3):
    import shutil

    for f in phi3[0].iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sliding_window"] = 512
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path), weights_only=True).arch.sliding_window is None


def test_partial_rotary_outside_phi3_is_refused(tmp_path_factory, tokenizer):
    path, _ = _tiny(tmp_path_factory, tokenizer, "llama-partial", rewrite=lambda c: c.update(partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match=r"unsupported partial_rotary_factor=0.5 for LlamaForCausalLM"):
        load_model(str(path), weights_only=True)


@pytest.mark.parametrize("arch, fields, message", [
    ("deepseek2", [("deepseek2.expert_count", 8)], r"unsupported GGUF architecture 'deepseek2' with "
                                                    r"deepseek2.expert_count=8 .*this mixture-of-experts model is not"),
    ("gemma2", [("gemma2.expert_count", 8)], r"'gemma2' with gemma2.expert_count=8 .*mixture-of-experts"),
    ("phimoe", [], r"'phimoe' .*this mixture-of-experts model is not supported"),
    ("llama", [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.yarn_attn_factor", 2.0)],
     r"unsupported GGUF llama.rope.scaling.yarn_attn_factor=2.0"),
    ("llama", [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.yarn_log_multiplier", 0.1)],
     r"unsupported GGUF llama.rope.scaling.yarn_log_multiplier=0.1"),
    ("llama", [("llama.rope.scaling.type", "longrope")], r"unsupported GGUF llama.rope.scaling.type='longrope'"),
    ("llama", [("llama.rope.dimension_count", 12)], r"unsupported GGUF llama.rope.dimension_count=12 .*partial"),
], ids=["deepseek2", "gemma2-experts", "phimoe", "yarn-attn-factor", "yarn-log-mul", "longrope-no-factors", "partial"])
def test_gguf_moe_and_rope_fields_are_refused(tmp_path, llama, arch, fields, message):
    path = _write_gguf(tmp_path / "x.gguf", llama[1], arch, LLAMA_NAMES, fields, permute=True)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), weights_only=True)


def test_phi3_gguf_window_shorter_than_the_context_is_read(tmp_path, phi3):
    path = _write_gguf(tmp_path / "w.gguf", phi3[1], "phi3", PHI3_NAMES,
                       [("phi3.attention.sliding_window", 256), ("phi3.rope.dimension_count", 12)])
    arch = load_model(str(path), weights_only=True).arch
    assert (arch.sliding_window, arch.layer_window(0), arch.layer_window(1)) == (256, 256, 256)


def test_phi3_with_a_sliding_window_matches_transformers(tmp_path_factory, tokenizer):
    """Phi-3-mini-4k style (its window, 2047, is shorter than its context): every layer windowed, here 5 tokens,
    so the prompts run past it."""
    path, hf = _randomize(*_tiny(tmp_path_factory, tokenizer, "phi3w", cls="Phi3", pad_token_id=0, sliding_window=5,
                                 original_max_position_embeddings=16, partial_rotary_factor=0.75,
                                 rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}))
    assert load_model(str(path), weights_only=True).arch.sliding_window == 5
    assert max(len(tokenizer.encode(p)) for p in PROMPTS) > 5
    _check_parity(path, hf, tokenizer)
    _engine_matches(path, hf, tokenizer)
