"""Gemma 2 and Gemma 3 text (issue 40, item 3): tiny random checkpoints written by ``transformers`` (norm weights
random, so a missed ``1 + w`` shows) give ``transformers``' logits (within 1e-4), prompt logprobs (within 1e-4) and
32 greedy tokens on the float32 path; the same weights written as llama.cpp writes a ``gemma2`` / ``gemma3`` GGUF
(its tensor names, norms stored as ``1 + w``) in F32 and Q8_0 give the same 12 greedy tokens (llama.cpp's gemma2
always soft-caps attention logits); the default quantized path runs a Q8_0 Gemma with 256-wide heads; every field
kvserve does not implement is refused by name.

Some checkpoints switch the attention window and soft-cap off (a window as long as ``max_position_embeddings``, no
soft-cap) to check the rest alone; the windowed ones (window 8-12 on 60-100-token prompts, soft-cap 50) check them."""

import json
import shutil

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from tests.conftest import assert_greedy_matches_transformers, flat_batch
from tests.model.test_families import PROMPTS, _check_parity, _logits, gguf_writer, qk_norms

pytestmark = pytest.mark.real_model  # the real model's tokenizer

#: 60-100-token prompts, longer than the windows of the windowed checkpoints
LONG_PROMPTS = [" ".join([p] * 4) for p in PROMPTS[:2]]  # 60-100 tokens each


def _gemma(tmp_path_factory, tokenizer, name, family, layers, **kw):
    """A random ``family`` ("Gemma2" / "Gemma3") checkpoint written by ``transformers``, every norm weight and bias
    drawn from N(0, 0.5) (``transformers`` starts them at 0: ``1 + w`` would be 1, a dropped bias would not show)."""
    import transformers

    torch.manual_seed(0)
    args = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                max_position_embeddings=512, sliding_window=512, attn_logit_softcapping=None,
                final_logit_softcapping=30.0, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                pad_token_id=0)
    args.update(kw)
    config = (transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig)(**args)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, tokenizer):
    """4 layers, sliding / full alternating (a window of 512 = max_position_embeddings: off)."""
    return _gemma(tmp_path_factory, tokenizer, "gemma2", "Gemma2", 4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer):
    """6 layers (5 local, 1 global), 256-wide heads, local RoPE base 1e4, global 1e6 with linear scaling."""
    return _gemma(tmp_path_factory, tokenizer, "gemma3", "Gemma3", 6, hidden_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, rope_theta=1e6,
                  rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})


def _fp32_llm(path):
    return LLM(model=str(path), num_kv_blocks=64, quantization="fp32")


def _prompt_logprobs_match(llm, hf, tokenizer, prompts=PROMPTS):
    """Every prompt token's logprob (and the top alternative's) within 1e-4 of ``transformers``' log-softmax."""
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert len(out.prompt_logprobs) == len(ids)
        for pos, (entry, token) in enumerate(zip(out.prompt_logprobs[1:], ids[1:])):
            assert token in entry and int(ref[pos].argmax()) in entry
            assert max(abs(lp - float(ref[pos, t])) for t, lp in entry.items()) < 1e-4, (prompt, pos)


def _check_family(path, hf, tokenizer, prompts=PROMPTS):
    """Logits (within 1e-4), prompt logprobs (within 1e-4) and 32 greedy tokens on each prompt equal
    ``transformers``'."""
    _check_parity(path, hf, tokenizer)
    llm = _fp32_llm(path)
    assert_greedy_matches_transformers(llm, hf, tokenizer, prompts, max_tokens=32)
    _prompt_logprobs_match(llm, hf, tokenizer, prompts)


def test_gemma2_matches_transformers(gemma2, tokenizer):
    path, hf = gemma2
    arch = load_model(str(path)).arch
    assert arch.architecture == "Gemma2ForCausalLM" and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2 and arch.final_logit_softcapping == 30.0
    _check_family(path, hf, tokenizer)


def test_gemma3_matches_transformers_and_its_local_rope_base_matters(gemma3, tokenizer):
    path, hf = gemma3
    loaded = load_model(str(path))
    a = loaded.arch
    assert (a.architecture, qk_norms(a), a.head_dim, a.rope_theta, a.local_rope_theta) == (
        "Gemma3ForCausalLM", {"head"}, 256, 1e6, 1e4)
    assert a.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and a.rope_scaling.factor == 8.0
    _check_family(path, hf, tokenizer)
    # the local layers' own base changes the logits: with the global table on every layer they move well past 1e-4
    model = build_model(loaded, select_backends("cpu", torch.float32, "fp32"))
    ids = tokenizer.encode(PROMPTS[0])
    right = _logits(model, ids)
    model.rope_tables[1] = model.rope_tables[0]  # the local layers' table (spec.ropes[1])
    assert (_logits(model, ids) - right).abs().max().item() > 1e-3


def test_gemma3_in_the_hub_config_layout(tmp_path, gemma3, tokenizer):
    """The Hub's Gemma 3 config.json: ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` (global layers
    only), ``sliding_window_pattern`` instead of ``layer_types``, defaults left out."""
    src, hf = gemma3
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.update(rope_theta=params["full_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=params["sliding_attention"]["rope_theta"], sliding_window_pattern=6)
    for key in ("layer_types", "_sliding_window_pattern", "attn_logit_softcapping", "hidden_activation"):
        cfg.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = load_model(str(tmp_path)).arch
    assert arch.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling.factor) == (1e6, 1e4, 8.0)
    _check_parity(tmp_path, hf, tokenizer)


def test_the_text_model_of_a_multimodal_gemma3_matches_transformers(tmp_path_factory, tokenizer):
    """``Gemma3ForConditionalGeneration`` (a tiny vision tower beside the text model): kvserve runs its text model
    (``text_config``, the ``language_model.`` tensors) and gives the multimodal model's logits on text prompts."""
    import transformers

    torch.manual_seed(0)
    v = len(tokenizer)
    text = dict(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512,
                sliding_window=512, final_logit_softcapping=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=v - 3, eoi_token_index=v - 2,
        image_token_index=v - 1)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "language_model" in n and "norm" in n:
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("gemma3mm")
    hf.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    loaded = load_model(str(path))
    assert loaded.arch.architecture == "Gemma3ForCausalLM" and qk_norms(loaded.arch) == {"head"}
    assert not any("vision" in k or "projector" in k for k in loaded.weights)
    _check_parity(path, hf, tokenizer, loaded)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["final_logit_softcapping"] = 30.0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported text_config.final_logit_softcapping=30.0 for "
                                         r"Gemma3ForConditionalGeneration \(transformers' multimodal class ignores "
                                         r"it\); supported: None"):
        load_model(str(path))


def test_query_pre_attn_scalar_and_attention_bias(tmp_path_factory, tokenizer):
    path, hf = _gemma(tmp_path_factory, tokenizer, "qpas", "Gemma2", 2, query_pre_attn_scalar=24,
                      attention_bias=True)
    arch = load_model(str(path)).arch
    assert arch.attention_scale == 24**-0.5 and arch.attention_bias and arch.o_proj_bias
    _check_parity(path, hf, tokenizer)


# ------------------------------------------------------------------------------------ window and soft-cap on


@pytest.fixture(scope="module")
def gemma2_windowed(tmp_path_factory, tokenizer):
    """As ``gemma2``, with a window of 8 tokens and attention logits soft-capped at 50."""
    return _gemma(tmp_path_factory, tokenizer, "gemma2w", "Gemma2", 4, sliding_window=8, attn_logit_softcapping=50.0)


@pytest.fixture(scope="module")
def gemma3_windowed(tmp_path_factory, tokenizer):
    """6 layers, a window of 12 tokens on the five local ones."""
    return _gemma(tmp_path_factory, tokenizer, "gemma3w", "Gemma3", 6, sliding_window=12, rope_theta=1e6,
                  rope_local_base_freq=1e4)


@pytest.mark.parametrize("family", ["gemma2_windowed", "gemma3_windowed"])
def test_windows_and_soft_caps_match_transformers(request, tokenizer, family):
    path, hf = request.getfixturevalue(family)
    _check_parity(path, hf, tokenizer)  # the short prompts
    model = build_model(load_model(str(path)), select_backends("cpu", torch.float32, "fp32"))
    for prompt in LONG_PROMPTS:
        ids = tokenizer.encode(prompt)
        assert 60 <= len(ids) <= 100
        kv = torch.zeros(model.kv_cache_shape(64, 4))
        out = model.forward(flat_batch([(ids, 0, list(range(63, 63 - (len(ids) + 3) // 4, -1)))], 4,
                                       logits_rows=range(len(ids))), kv)
        with torch.no_grad():
            assert (out - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4
    llm = _fp32_llm(path)
    assert_greedy_matches_transformers(llm, hf, tokenizer, LONG_PROMPTS, max_tokens=32)
    _prompt_logprobs_match(llm, hf, tokenizer, LONG_PROMPTS)


# ----------------------------------------------------------------------------------------------------------- GGUF

#: Hugging Face -> llama.cpp tensor names of a Gemma layer (gguf-py's tensor map for gemma2 / gemma3).
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}


def _write_gemma_gguf(path, hf, qtype="F32", extra_fields=(), extra_tensors=()):
    """``hf``'s weights as llama.cpp's converter writes a Gemma GGUF: its tensor names, Q/K rows as they are
    (rope type neox), every norm weight stored as ``1 + w``, no ``output.weight`` (tied), the 2-D tensors in
    ``qtype`` ("F32" or "Q8_0"); plus ``extra_fields`` ``[(key, value)]`` and ``extra_tensors``."""
    import gguf

    c = hf.config
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    w = gguf_writer(path, c, arch)
    if c.head_dim == c.hidden_size // c.num_attention_heads:  # llama.cpp's converter writes Gemma's always
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_sliding_window(c.sliding_window)
    if c.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if c.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    for key, value in extra_fields:
        w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
    tensors = list(extra_tensors)
    for name, t in hf.state_dict().items():
        x = t.float().numpy()
        if name == "lm_head.weight":
            continue
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            g = f"blk.{layer}.{_GGUF_LAYER[module]}.{suffix}"
        tensors.append((g, x + np.float32(1.0) if name.endswith("norm.weight") else x))
    for g, x in tensors:
        q = gguf.GGMLQuantizationType.Q8_0 if qtype == "Q8_0" and x.ndim == 2 else None
        w.add_tensor(g, gguf.quants.quantize(x, q) if q else np.ascontiguousarray(x), raw_dtype=q)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


def _hf_with(hf, weights):
    """A copy of ``hf`` holding ``weights`` (a ``LoadedModel``'s: the GGUF's values, dequantized)."""
    copy = type(hf)(hf.config).eval()
    copy.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    copy.tie_weights()
    return copy


def _greedy(model, ids, n, block_size=4):
    """``n`` greedy tokens of kvserve's ``model`` after ``ids``: a prefill, then one decode step per token over
    the paged cache."""
    kv = torch.zeros(model.kv_cache_shape(64, block_size))
    table = list(range(63, 63 - (len(ids) + n + block_size - 1) // block_size, -1))
    logits, out = model.forward(flat_batch([(ids, 0, table)], block_size), kv), []
    for step in range(n):
        out.append(int(logits[0].argmax()))
        logits = model.forward(flat_batch([([out[-1]], len(ids) + step, table)], block_size), kv)
    return out


def _hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", [
    "gemma3", "gemma2_windowed",  # llama.cpp's gemma2 always soft-caps
])
def test_a_gemma_gguf_gives_transformers_tokens(tmp_path, request, tokenizer, family, qtype):
    _, hf = request.getfixturevalue(family)
    path = _write_gemma_gguf(tmp_path / f"{family}.gguf", hf, qtype)
    loaded = load_model(str(path), weights_only=True)
    assert loaded.arch.architecture == hf.config.architectures[0] and loaded.arch.tie_word_embeddings
    assert loaded.arch.layer_types == tuple(hf.config.layer_types)
    if qtype == "F32":  # the norms come back as w, bit for bit where 1 + w is exact
        ref = hf.state_dict()["model.layers.0.pre_feedforward_layernorm.weight"]
        assert torch.allclose(loaded.weights["model.layers.0.pre_feedforward_layernorm.weight"], ref, atol=1e-7)
    reference = _hf_with(hf, loaded.weights)
    model = build_model(loaded, select_backends("cpu", torch.float32, "fp32"))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids, 12) == _hf_greedy(reference, ids, 12), prompt


def test_a_gemma2_gguf_without_its_soft_caps_has_llama_cpps_defaults(tmp_path, gemma2):
    """llama.cpp's gemma2 reads both soft-caps as optional, 50 and 30 (the Gemma 2 paper's values) when absent."""
    _, hf = gemma2
    hf.config.final_logit_softcapping = None  # neither key written
    try:
        path = _write_gemma_gguf(tmp_path / "g2.gguf", hf)
    finally:
        hf.config.final_logit_softcapping = 30.0
    arch = load_model(str(path), weights_only=True).arch
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping, arch.sliding_window) == (50.0, 30.0, 512)
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2 and arch.attention_scale == 32**-0.5


def test_the_default_quantized_path_runs_a_q8_0_gemma(tmp_path, gemma3, tokenizer):
    """The Q8_0 GGUF on the default path (kept quantized: int8 kernels; 256-wide heads on the CPU attention
    kernel): its prompt logits pick the float32 path's top token at almost every position."""
    _, hf = gemma3
    path = _write_gemma_gguf(tmp_path / "q8.gguf", hf, "Q8_0")
    quantized = build_model(load_model(str(path), keep_quantized=True, weights_only=True),
                            select_backends("cpu", torch.float32, "auto"))
    assert "q8" in quantized.layers[0]["qkv"].path and quantized.attn.name == "cpu-kernels"
    exact = build_model(load_model(str(path), weights_only=True), select_backends("cpu", torch.float32, "fp32"))
    agree = total = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        q, f = _logits(quantized, ids), _logits(exact, ids)
        assert (q - f).abs().max().item() < 0.1
        agree += int((q.argmax(-1) == f.argmax(-1)).sum())
        total += len(ids)
    assert agree >= 0.9 * total


# ----------------------------------------------------------------------------------------------------- refusals


def _edited(tmp_path, src, edit):
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("family, edit, message", [
    ("gemma3", lambda c: c.update(attn_logit_softcapping=50.0),
     r"unsupported attn_logit_softcapping=50.0 for Gemma3ForCausalLM in .*; supported: \(None,\)"),
    ("gemma2", lambda c: c.update(use_bidirectional_attention=True),
     r"unsupported use_bidirectional_attention=True for Gemma2ForCausalLM in .*; supported: \(None, False\)"),
    ("gemma2", lambda c: c.update(hidden_activation="relu"),
     r"unsupported hidden_activation='relu' for Gemma2ForCausalLM"),
    ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="mrope"),
     r"unsupported rope_parameters.rope_type='mrope' in .*\(rope_parameters.full_attention\)"),
    ("gemma2", lambda c: c.update(num_experts=4), r"unsupported num_experts=4 for Gemma2ForCausalLM"),
], ids=["gemma3-attn-softcap", "bidirectional", "relu", "rope-unknown", "moe"])
def test_gemma_fields_kvserve_does_not_implement_are_refused(tmp_path, request, family, edit, message):
    path = _edited(tmp_path, request.getfixturevalue(family)[0], edit)
    with pytest.raises(ValueError, match=message):
        build_model(load_model(str(path)), select_backends("cpu", torch.float32, "fp32"))


def test_gemma_weights_without_their_feed_forward_norms_are_refused(tmp_path, gemma2):
    from safetensors.torch import load_file, save_file

    path = _edited(tmp_path, gemma2[0], lambda c: None)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.post_feedforward_layernorm.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM needs these norm weights; missing "
                                         r"\['model.layers.1.post_feedforward_layernorm.weight'\]"):
        build_model(load_model(str(path)), select_backends("cpu", torch.float32, "fp32"))


@pytest.mark.parametrize("family, extra_fields, extra_tensors, message", [
    ("gemma2", [], [("blk.0.attn_q_norm.weight", np.ones(32, np.float32))],
     r"unknown GGUF tensor\(s\) \['blk.0.attn_q_norm.weight'\]"),
    ("gemma3", [("gemma3.attn_logit_softcapping", 50.0)], [],
     r"unsupported GGUF gemma3.attn_logit_softcapping=50.0"),
    ("gemma2", [("gemma2.expert_count", 8)], [],
     r"'gemma2' with gemma2.expert_count=8 .*this mixture-of-experts model is not supported"),
], ids=["q-norm-in-gemma2", "gemma3-attn-softcap", "moe"])
def test_gemma_gguf_fields_kvserve_does_not_implement_are_refused(tmp_path, request, family, extra_fields,
                                                                  extra_tensors, message):
    path = _write_gemma_gguf(tmp_path / "x.gguf", request.getfixturevalue(family)[1], "F32", extra_fields,
                             extra_tensors)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), weights_only=True)


def test_an_early_exit_draft_of_a_windowed_gemma_keeps_the_targets_tokens(gemma3_windowed, tokenizer):
    """The draft is the first 3 of 6 layers: their window kinds come with them (``layer_types`` cut to 3), and
    speculative decoding leaves greedy tokens as the target alone gives them."""
    path, _ = gemma3_windowed
    spec = LLM(model=str(path), num_kv_blocks=64, quantization="fp32",
               speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 3})
    draft = spec.llm_engine.speculator.proposer.model
    assert draft.arch.layer_types == ("sliding_attention",) * 3
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _fp32_llm(path).generate(LONG_PROMPTS, sp)]
    assert [o.outputs[0].token_ids for o in spec.generate(LONG_PROMPTS, sp)] == want
