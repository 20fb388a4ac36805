"""Model families and config fields (issue 40, first part): tiny random checkpoints written by ``transformers`` from a
config -- Llama 3.x RoPE scaling in both config layouts, linear and YaRN scaling, Llama with every projection
biased, a GELU-gated MLP -- give ``transformers``' logits (within 1e-4) and greedy tokens on the float32 path; the
same weights written as a GGUF (llama.cpp's names and Q/K row order, Llama 3.1's scaling as ``rope_freqs.weight``;
Qwen2 as the ``qwen2`` architecture) give the same logits; every field kvserve does not implement is refused with a
message naming it."""

import json

import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.layers.rotary import RopeScaling, rope_frequencies
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model, model_class
from tests.conftest import assert_greedy_matches_transformers, flat_batch

pytestmark = pytest.mark.real_model  # the real model's tokenizer

PROMPTS = ["The capital of France is a city of lights and of long walks along the river, where people",
           "Once upon a time, in a land far away, there lived a king who had three daughters and a",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _tiny(tmp_path_factory, tokenizer, name, cls="Llama", rewrite=None, bias=False, **kw):
    """A 2-layer random checkpoint of ``cls`` written by ``transformers`` (biases drawn at random so a dropped one
    shows); ``rewrite(cfg_dict)`` edits its config.json afterwards (e.g. into the Hub's ``rope_scaling`` layout)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(
        **{"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, **kw})
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    if bias:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    if rewrite is not None:
        cfg = json.loads((path / "config.json").read_text())
        rewrite(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path, model


def _logits(model, ids):
    kv = torch.zeros(model.kv_cache_shape(32, 4))
    table = list(range(31, 31 - (len(ids) + 3) // 4, -1))
    return model.forward(flat_batch([(ids, 0, table)], 4, logits_rows=range(len(ids))), kv)


def _check_parity(path, hf, tokenizer, loaded=None):
    """Logits within 1e-4 of ``transformers`` on every prompt, then (for a directory) 12 greedy tokens equal."""
    loaded = loaded or load_model(str(path))
    model = build_model(loaded, select_backends("cpu", torch.float32, "fp32"))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (_logits(model, ids) - ref).abs().max().item() < 1e-4, prompt
    return model


def _greedy_equal(path, hf, tokenizer):
    assert_greedy_matches_transformers(LLM(model=str(path), num_kv_blocks=64, quantization="fp32"), hf, tokenizer,
                                       PROMPTS)


def _hub_layout(cfg):
    """transformers 5's ``rope_parameters`` -> the Hub's ``rope_theta`` + ``rope_scaling`` (with "type")."""
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type" if params["rope_type"] == "linear" else "rope_type": params.pop("rope_type"),
                           **params}


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, tokenizer):
    return _tiny(tmp_path_factory, tokenizer, "llama3", rope_theta=500000.0, rope_scaling=dict(LLAMA3))


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("scaling", [
    LLAMA3,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
], ids=["llama3", "linear", "yarn"])
def test_rope_scaling_matches_transformers_in_both_config_layouts(tmp_path_factory, tokenizer, scaling, layout):
    path, hf = _tiny(tmp_path_factory, tokenizer, scaling["rope_type"], rope_theta=500000.0,
                     rope_scaling=dict(scaling), rewrite=_hub_layout if layout == "rope_scaling" else None)
    cfg = json.loads((path / "config.json").read_text())
    assert (layout in cfg) and not (set(cfg) & {"rope_scaling", "rope_parameters"} - {layout})
    loaded = load_model(str(path))
    assert loaded.arch.rope_scaling.rope_type == scaling["rope_type"]
    model = _check_parity(path, hf, tokenizer, loaded)
    # the scaling matters at these lengths: without it the logits move well past the tolerance
    plain = build_model(load_model(str(path)), select_backends("cpu", torch.float32, "fp32"))
    plain.rope_tables[0].inv_freq, plain.rope_tables[0].attention_scaling = rope_frequencies(16, 500000.0)[0], 1.0
    ids = tokenizer.encode(PROMPTS[0])
    assert (_logits(plain, ids) - _logits(model, ids)).abs().max().item() > 1e-3


def test_llama3_greedy_tokens_match_transformers(llama3, tokenizer):
    _greedy_equal(*llama3, tokenizer)


@pytest.mark.parametrize("kw", [
    {"attention_bias": True, "mlp_bias": True},
    {"hidden_act": "gelu_pytorch_tanh"},
    {"hidden_act": "gelu"},
], ids=["biases", "gelu-tanh", "gelu"])
def test_llama_variants_match_transformers(tmp_path_factory, tokenizer, kw):
    path, hf = _tiny(tmp_path_factory, tokenizer, "variant", bias=True, **kw)
    model = _check_parity(path, hf, tokenizer)
    assert model.fused_layers is None  # float32 projections (fp32): the Python loop (int8: test_layer_spec.py)
    _greedy_equal(path, hf, tokenizer)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(rope_parameters={"rope_type": "mrope", "factor": 2.0, "rope_theta": 1e4}),
     r"unsupported rope_parameters.rope_type='mrope'"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                         "original_max_position_embeddings": 16, "rope_theta": 1e4}),
     r"short_factor have 1 entries; the rotated width 16 needs 8"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
     r"lacks \['high_freq_factor'"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta": 3, "rope_theta": 5e5}),
     r"key\(s\) \['beta'\]"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
    (lambda c: c.update(rope_scaling={"type": "su", "factor": 2.0}), r"unsupported rope_scaling.type='su'"),
    (lambda c: c.update(sliding_window=4096), r"unsupported sliding_window=4096 for LlamaForCausalLM"),
    (lambda c: c.update(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0"),
    (lambda c: c.update(residual_multiplier=0.22), r"residual_multiplier=0.22"),
    (lambda c: c.update(num_local_experts=8), r"num_local_experts=8"),
    (lambda c: c.update(hidden_act="relu"), r"unsupported hidden_act='relu' for LlamaForCausalLM"),
    (lambda c: c.update(mlp_bias=True), r"sets mlp_bias=true but the weights lack"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), r"layer_types="),
], ids=["unknown-type", "longrope-length", "llama3-missing-key", "unknown-key", "partial-rotary", "hub-type-key", "sliding-window",
        "softcap", "granite", "moe", "relu", "bias-missing", "layer-types"])
def test_fields_kvserve_does_not_implement_are_refused_by_name(tmp_path, llama3, edit, message):
    import shutil

    src, _ = llama3
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        build_model(load_model(str(tmp_path)), select_backends("cpu", torch.float32, "fp32"))


def test_weights_with_a_bias_the_config_does_not_declare_are_refused(tmp_path_factory, tokenizer):
    path, _ = _tiny(tmp_path_factory, tokenizer, "undeclared", attention_bias=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"needs Q/K/V biases|does not set attention_bias"):
        build_model(load_model(str(path)), select_backends("cpu", torch.float32, "fp32"))


# ----------------------------------------------------------------------------------------------------------- GGUF

#: Hugging Face -> llama.cpp tensor names (the loader maps them back).
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _permute(w, n_head):
    """llama.cpp's converter's Q/K row order (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer(path, c, arch: str):
    """A ``gguf.GGUFWriter`` of ``arch`` at ``path`` holding the sizes of the ``transformers`` config ``c`` (layers,
    context, widths, heads, a head width that is not hidden / heads, the RMSNorm epsilon), as llama.cpp's
    converter writes them; the caller adds the rest."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if getattr(c, "head_dim", None) not in (None, c.hidden_size // c.num_attention_heads):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    return w


def _write_gguf(path, hf, arch, permute, extra_tensors=(), extra_fields=(), q5_0=(), q8_0=()):
    """``hf``'s weights as a float32 GGUF of ``arch`` with llama.cpp's tensor names (Q/K rows permuted when
    ``permute``; the tensors named in ``q5_0`` / ``q8_0`` as Q5_0 / Q8_0 blocks), plus ``extra_tensors``
    ``[(name, array)]`` and ``extra_fields`` ``[(key, value)]`` (int, float, bool, str or a list of them)."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c, arch)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    for key, value in extra_fields:  # an int as uint32 (llama.cpp's counts and token ids); else by its type
        if isinstance(value, int) and not isinstance(value, bool):
            w.add_uint32(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, t in hf.state_dict().items():
        x, g = t.float().numpy(), _GGUF_TOP.get(name)
        if g is None:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            g = f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads
                x = _permute(x, heads)
        q = gguf.GGMLQuantizationType.Q5_0 if g in q5_0 else gguf.GGMLQuantizationType.Q8_0 if g in q8_0 else None
        if q is not None:
            w.add_tensor(g, gguf.quants.quantize(x, q), raw_dtype=q)
        else:
            w.add_tensor(g, np.ascontiguousarray(x))
    for name, x in extra_tensors:
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path, llama3, tokenizer):
    _, hf = llama3
    default, _ = rope_frequencies(16, 500000.0)
    scaled, _ = rope_frequencies(16, 500000.0, RopeScaling(**LLAMA3))
    path = _write_gguf(tmp_path / "l3.gguf", hf, "llama", True, [("rope_freqs.weight", (default / scaled).numpy())])
    loaded = load_model(str(path), weights_only=True)
    assert loaded.arch.rope_scaling.freq_factors is not None
    _check_parity(path, hf, tokenizer, loaded)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "qwen3", cls="Qwen3", rope_theta=1000000.0, head_dim=32)
    with torch.no_grad():  # norms away from 1, so a skipped Q/K norm shows
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    return path, hf


def qk_norms(arch) -> set:
    """The Q/K norm kinds of ``arch``'s layers, as its family's spec declares them."""
    return {s.qk_norm for s in model_class(arch.architecture).spec(arch).layers}


def test_qwen3_matches_transformers_from_hf_and_gguf(qwen3, tokenizer):
    path, hf = qwen3
    loaded = load_model(str(path))
    assert loaded.arch.architecture == "Qwen3ForCausalLM" and qk_norms(loaded.arch) == {"head"}
    assert loaded.arch.head_dim == 32
    assert _check_parity(path, hf, tokenizer, loaded).fused_layers is None
    _greedy_equal(path, hf, tokenizer)
    gguf_path = _write_gguf(path / "q3.gguf", hf, "qwen3", False)
    _check_parity(gguf_path, hf, tokenizer, load_model(str(gguf_path), weights_only=True))


def test_q5_0_tensors_stay_quantized(tmp_path, llama3, caplog):
    """A Q5_0 tensor is kept in its block format under the default (the int8 kernels read it, issue 40 item 5):
    nothing is widened to float32, so the loader has nothing to warn about."""
    import logging

    from kvserve.quant import QuantTensor

    _, hf = llama3
    path = _write_gguf(tmp_path / "q5.gguf", hf, "llama", True, q5_0=("blk.0.ffn_down.weight", "blk.1.ffn_down.weight"))
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        loaded = load_model(str(path), keep_quantized=True, weights_only=True)
    w = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, QuantTensor) and w.qtype.name == "Q5_0"
    assert not any("dequantized to float32" in r.getMessage() for r in caplog.records)


def test_mistral_without_a_window_is_llama(tmp_path_factory, tokenizer):
    """(With a window: tests/model/test_sliding_window.py.)"""
    path, hf = _tiny(tmp_path_factory, tokenizer, "mistral", cls="Mistral", sliding_window=None, head_dim=16)
    assert load_model(str(path)).arch.architecture == "MistralForCausalLM"
    _check_parity(path, hf, tokenizer)


def test_granite_multipliers_match_transformers_from_hf_and_gguf(tmp_path_factory, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "granite", cls="Granite", embedding_multiplier=12.0,
                     residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)
    arch = load_model(str(path)).arch
    assert (arch.embedding_multiplier, arch.residual_multiplier, arch.attention_scale, arch.logits_scaling) == (
        12.0, 0.22, 0.0078125, 8.0)
    assert _check_parity(path, hf, tokenizer).fused_layers is None
    _greedy_equal(path, hf, tokenizer)
    fields = [("granite.embedding_scale", 12.0), ("granite.residual_scale", 0.22),
              ("granite.attention.scale", 0.0078125), ("granite.logit_scale", 8.0)]
    gguf_path = _write_gguf(path / "g.gguf", hf, "granite", True, extra_fields=fields)
    loaded = load_model(str(gguf_path), weights_only=True)
    assert loaded.arch.architecture == "GraniteForCausalLM" and loaded.arch.logits_scaling == 8.0
    _check_parity(gguf_path, hf, tokenizer, loaded)


def test_smollm3_nope_layers_match_transformers(tmp_path_factory, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "smollm3", cls="SmolLM3", no_rope_layers=[1, 0], pad_token_id=0,
                     rope_theta=10000.0)
    assert load_model(str(path)).arch.no_rope_layers == (1, 0)
    assert _check_parity(path, hf, tokenizer).fused_layers is None
    _greedy_equal(path, hf, tokenizer)


def test_a_smollm3_gguf_has_llama_cpps_nope_layers(tmp_path_factory, tokenizer):
    """llama.cpp's smollm3 skips RoPE on every 4th layer (a constant there, no GGUF key): a 4-layer checkpoint with
    Hugging Face's default interval of 4 (layer 3 without RoPE) gives the same logits from its GGUF."""
    path, hf = _tiny(tmp_path_factory, tokenizer, "smollm3-4", cls="SmolLM3", num_hidden_layers=4, pad_token_id=0,
                     rope_theta=10000.0)
    assert list(hf.config.no_rope_layers) == [1, 1, 1, 0]
    gguf_path = _write_gguf(path / "s.gguf", hf, "smollm3", True)
    loaded = load_model(str(gguf_path), weights_only=True)
    assert (loaded.arch.architecture, loaded.arch.no_rope_layers) == ("SmolLM3ForCausalLM", (1, 1, 1, 0))
    _check_parity(gguf_path, hf, tokenizer, loaded)


def test_a_qwen2_gguf_keeps_its_rows_and_biases(tmp_path_factory, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "qwen2", cls="Qwen2", bias=True, rope_theta=10000.0)
    gguf_path = _write_gguf(path / "q.gguf", hf, "qwen2", False)
    loaded = load_model(str(gguf_path), weights_only=True)
    assert loaded.arch.architecture == "Qwen2ForCausalLM" and loaded.arch.attention_bias
    _check_parity(gguf_path, hf, tokenizer, loaded)


@pytest.mark.parametrize("extra_tensors, extra_fields, message", [
    ([("blk.0.attn_q_norm.weight", np.ones(16, np.float32))], [], r"unknown GGUF tensor\(s\) \['blk.0.attn_q_norm"),
    ([], [("llama.rope.dimension_count", 8)], r"rope.dimension_count=8"),
    ([], [("llama.expert_count", 8)], r"unknown GGUF tensor\(s\) \['blk.0.ffn_down.weight'"),  # Mixtral's names
], ids=["unknown-tensor", "partial-rotary", "moe"])
def test_gguf_fields_and_tensors_kvserve_does_not_implement_are_refused(tmp_path, llama3, extra_tensors,
                                                                        extra_fields, message):
    path = _write_gguf(tmp_path / "x.gguf", llama3[1], "llama", True, extra_tensors, extra_fields)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), weights_only=True)
