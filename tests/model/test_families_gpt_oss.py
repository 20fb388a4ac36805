"""gpt-oss (issue 49): a tiny random checkpoint written by ``transformers`` (attention sinks, the window on every
other layer, YaRN, Q/K/V/o biases, the biased top-k-then-softmax router, clamped-SwiGLU experts with biases) gives
``transformers``' 32 greedy tokens on 3 prompts and every prompt logprob within 1e-4 through the engine on the float32
path; the same checkpoint with its experts as MXFP4 ``*_blocks`` / ``*_scales`` (as released) gives the tokens of
``transformers`` holding those values; the default quantized path runs it, the C layer loop giving the Python loop's
bits."""

import copy
import json

import numpy as np
import pytest
import torch

from kvserve.config import KernelConfig
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from kvserve.quant.pack import FMT_MX4
from tests.model.test_families import _GGUF_TOP, PROMPTS, _logits, gguf_writer
from tests.model.test_families_phi3_olmo2 import _engine_matches, _fp32, _greedy, _hf_greedy, _randomize

pytestmark = pytest.mark.real_model  # the real model's tokenizer

E, K, WINDOW = 8, 2, 6
#: FP4 (E2M1) values of the 16 codes (transformers' ``FP4_VALUES``).
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _tiny_gpt_oss(path, tokenizer):
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
        num_local_experts=E, num_experts_per_tok=K, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "experts" in n:
                p.normal_(0, 0.1 if not n.endswith("_bias") else 0.5)
            elif n.endswith("router.weight"):
                p.normal_(0, 1.0)
            elif n.endswith("sinks"):
                p.normal_(0, 1.5)
            elif n.endswith("embed_tokens.weight"):  # (larger than the biases: rows choose varied experts)
                p.normal_(0, 1.0)
    tokenizer.save_pretrained(str(path))
    return _randomize(path, hf)  # norms and biases


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tokenizer):
    return _tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), tokenizer)


def test_gpt_oss_matches_transformers(gpt_oss, tokenizer):
    """32 greedy tokens on 3 prompts (longer than the window) and every prompt logprob within 1e-4 (float32)."""
    path, hf = gpt_oss
    arch = load_model(str(path), weights_only=True).arch
    assert (arch.moe.num_experts, arch.moe.top_k, arch.sliding_window) == (E, K, WINDOW)
    assert arch.layer_types == ("sliding_attention", "full_attention") and arch.rope_scaling.rope_type == "yarn"
    assert arch.attention_bias and arch.o_proj_bias
    _engine_matches(path, hf, tokenizer)


def _mxfp4(shape, g):
    """Random MXFP4 ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32], values float32 [..., N, K])``:
    scales 2^-6 .. 2^-3 (values up to 0.75)."""
    *lead, n, k = shape
    codes = torch.randint(0, 16, (*lead, n, k), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 6, 127 - 2, (*lead, n, k // 32), generator=g, dtype=torch.uint8)
    values = FP4[codes.long()] * torch.pow(2.0, scales.float() - 127).repeat_interleave(32, -1)
    c = codes.reshape(*lead, n, k // 32, 16, 2)
    return c[..., 0] | (c[..., 1] << 4), scales, values


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, tokenizer):
    """The checkpoint above with every expert projection MXFP4 (``*_blocks`` / ``*_scales`` over the float
    tensors), and ``transformers`` holding those values."""
    from safetensors.torch import load_file, save_file

    path, hf = _tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4"), tokenizer)
    g = torch.Generator().manual_seed(5)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(str(f))
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name)  # [E, in, out]
                blocks, scales, values = _mxfp4((E, w.shape[2], w.shape[1]), g)  # [E, out, in]
                w.copy_(values.transpose(1, 2))
                key = f"model.layers.{i}.mlp.experts.{name}"
                del tensors[key]
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg))
    return path, hf


def test_gpt_oss_mxfp4_experts_match_transformers_and_run_quantized(gpt_oss_mxfp4, tokenizer):
    """MXFP4 experts from ``*_blocks`` / ``*_scales``: the float32 path gives the greedy tokens of
    ``transformers`` holding the same values; the default path keeps them MXFP4 (the MX4 kernel), its logits near
    the float32 path's; on the int8 path (every projection on a kernel) the C layer loop (sinks included) gives the
    Python loop's bits."""
    path, hf = gpt_oss_mxfp4
    model = _fp32(path)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids) == _hf_greedy(hf, ids), prompt
    loaded = load_model(str(path), keep_quantized=True, weights_only=True)
    kc = KernelConfig(quant_activations="int8x2")
    quant = build_model(loaded, select_backends("cpu", torch.float32, "auto", kc))
    experts = quant.layers[0]["moe"].experts
    assert experts[0].down.packed.fmt == experts[3].gate_up.packed.fmt == FMT_MX4
    ids = tokenizer.encode(PROMPTS[0])
    assert (_logits(quant, ids) - _logits(model, ids)).abs().max().item() < 0.05
    int8 = build_model(loaded, select_backends("cpu", torch.float32, "int8", kc))
    assert int8.fused_layers is not None
    got = _logits(int8, ids)
    int8.fused_layers = None
    assert torch.equal(got, _logits(int8, ids))


def test_sinks_missing_or_misshapen_are_refused(gpt_oss):
    path, _ = gpt_oss
    loaded = load_model(str(path), weights_only=True)
    weights = dict(loaded.weights)
    del weights["model.layers.1.self_attn.sinks"]
    with pytest.raises(ValueError, match="self_attn.sinks"):
        type(build_model(loaded, select_backends("cpu", torch.float32, "fp32")))(
            loaded.arch, weights, select_backends("cpu", torch.float32, "fp32"))
    weights["model.layers.1.self_attn.sinks"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        type(build_model(loaded, select_backends("cpu", torch.float32, "fp32")))(
            loaded.arch, weights, select_backends("cpu", torch.float32, "fp32"))


def test_mxfp4_relayout_is_exact():
    """``mxfp4_tensor``'s GGUF blocks decode to the values of the Hugging Face blocks."""
    from kvserve.model.gpt_oss import mxfp4_tensor

    blocks, scales, values = _mxfp4((3, 5, 64), torch.Generator().manual_seed(1))
    t = mxfp4_tensor("w", blocks, scales)
    assert t.experts == 3 and t.shape == (15, 64)
    np.testing.assert_array_equal(t.dequantize(), values.reshape(15, 64).numpy())


def _gguf_tensors(hf):
    """llama.cpp's ``gpt-oss`` tensors of ``hf``: ``[(name, float32 array)]`` (its converter's names: the fused
    interleaved gate/up cut into ``ffn_gate_exps`` / ``ffn_up_exps``, the experts ``[E, out, in]``)."""
    sd = {n: t.float().numpy() for n, t in hf.state_dict().items()}
    out = [(g, sd[n]) for n, g in _GGUF_TOP.items()]
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
             "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             **{f"self_attn.{m}_proj.{s}": f"attn_{g}.{s}" for m, g in zip("qkvo", ("q", "k", "v", "output"))
                for s in ("weight", "bias")}}
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(f"blk.{i}.{g}", sd[p + n]) for n, g in names.items()]
        gate_up, gate_up_bias = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"]
        out += [(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :, 0::2].transpose(0, 2, 1)),
                (f"blk.{i}.ffn_up_exps.weight", gate_up[:, :, 1::2].transpose(0, 2, 1)),
                (f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)),
                (f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[:, 0::2]),
                (f"blk.{i}.ffn_up_exps.bias", gate_up_bias[:, 1::2]),
                (f"blk.{i}.ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"])]
    return out


def _write_gpt_oss_gguf(path, hf, mxfp4: bool):
    """``hf`` as llama.cpp's converter writes a gpt-oss GGUF (F32; the expert weights MXFP4 with ``mxfp4``)."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c, "gpt-oss")
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_uint32("gpt-oss.expert_count", E)
    w.add_uint32("gpt-oss.expert_used_count", K)
    w.add_uint32("gpt-oss.expert_feed_forward_length", c.intermediate_size)
    w.add_uint32("gpt-oss.attention.sliding_window", WINDOW)
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    w.add_float32("gpt-oss.rope.scaling.factor", c.rope_parameters["factor"])
    w.add_uint32("gpt-oss.rope.scaling.original_context_length", c.rope_parameters["original_max_position_embeddings"])
    for name, x in _gguf_tensors(hf):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if mxfp4 and name.endswith("_exps.weight"):
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_reference(hf, mxfp4: bool):
    """A copy of ``hf`` computing what llama.cpp's ``gpt-oss`` graph computes from the file: YaRN's correction range
    truncated to whole dimensions (transformers' ``truncate=True``), the experts' MXFP4 round trip with ``mxfp4``."""
    import gguf

    ref = copy.deepcopy(hf)
    ref.config.rope_parameters = {**ref.config.rope_parameters, "truncate": True}
    ref.model.rotary_emb = type(ref.model.rotary_emb)(ref.config)
    if mxfp4:
        q = gguf.GGMLQuantizationType.MXFP4
        with torch.no_grad():
            for layer in ref.model.layers:
                for name in ("gate_up_proj", "down_proj"):
                    p = getattr(layer.mlp.experts, name)  # [E, in, out]: the file's rows are its columns
                    x = np.ascontiguousarray(p.transpose(1, 2).float().numpy())
                    back = gguf.quants.dequantize(gguf.quants.quantize(x, q), q).reshape(x.shape)
                    p.copy_(torch.from_numpy(back).transpose(1, 2))
    return ref


@pytest.mark.parametrize("mxfp4", [False, True], ids=["F32", "MXFP4"])
def test_gpt_oss_gguf_gives_transformers_tokens(tmp_path, gpt_oss, tokenizer, mxfp4):
    """llama.cpp's ``gpt-oss`` GGUF of the same weights (sinks, biases, the window pattern, YaRN keys): the
    float32 path gives the greedy tokens of transformers computing llama.cpp's graph on the file's values; with
    MXFP4 experts the default path keeps them MXFP4 and its logits stay near the float32 path's."""
    _, hf = gpt_oss
    path = _write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", hf, mxfp4)
    model, ref = _fp32(path), _llama_cpp_reference(hf, mxfp4)
    a = model.arch
    assert (a.moe.num_experts, a.moe.top_k, a.sliding_window) == (E, K, WINDOW)
    assert a.layer_types == ("sliding_attention", "full_attention") and a.rope_scaling.rope_type == "yarn"
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids) == _hf_greedy(ref, ids), prompt
    if not mxfp4:
        return
    quant = build_model(load_model(str(path), keep_quantized=True, weights_only=True),
                        select_backends("cpu", torch.float32, "auto", KernelConfig(quant_activations="int8x2")))
    assert quant.layers[1]["moe"].experts[5].gate_up.packed.fmt == FMT_MX4
    ids = tokenizer.encode(PROMPTS[1])
    assert (_logits(quant, ids) - _logits(model, ids)).abs().max().item() < 0.05
