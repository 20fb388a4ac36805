"""Mixture-of-experts families (issue 49): tiny random checkpoints written by ``transformers`` from a config (norms,
biases and routers random, far from ties) give ``transformers``' 32 greedy tokens on 3 prompts and every prompt
logprob within 1e-4 through the engine on the float32 path; the same weights written as llama.cpp would
(``ffn_gate_inp``, the experts stacked as ``ffn_{gate,up,down}_exps``, ``<arch>.expert_count`` /
``expert_used_count`` / ``expert_feed_forward_length``) as F32, Q8_0 and Q5_K GGUFs (a K-quant: the Q5_K quantizer of
``kvserve.quant.kquantize``; ``gguf`` writes no Q4_K) give the tokens of
``transformers`` holding the file's values (float32 path), and the default quantized path runs them (Python and C
layer loops bit for bit the same where the C loop runs)."""

import copy

import numpy as np
import pytest
import torch

from kvserve.config import KernelConfig
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from tests.model.test_families import PROMPTS, _GGUF_TOP, _logits, _permute, gguf_writer
from tests.model.test_families_phi3_olmo2 import _engine_matches, _fp32, _greedy, _hf_greedy, _randomize

pytestmark = pytest.mark.real_model  # the real model's tokenizer

E, K = 8, 2
ATTN = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
#: family -> (transformers class prefix, config fields, GGUF architecture, Q/K rows permuted in the GGUF,
#: extra GGUF metadata (key after "<arch>.", value))
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=E, moe_intermediate_size=256, norm_topk_prob=True, head_dim=16),
                  "qwen3moe", False, [("expert_feed_forward_length", 256)]),
    "olmoe": ("Olmoe", dict(num_experts=E, intermediate_size=256, norm_topk_prob=False), "olmoe", False, []),
    "mixtral": ("Mixtral", dict(num_local_experts=E, intermediate_size=256), "llama", True, []),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=E, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                   norm_topk_prob=False), "qwen2moe", False,
                  [("expert_feed_forward_length", 256), ("expert_shared_feed_forward_length", 256)]),
    "granitemoe": ("GraniteMoe", dict(num_local_experts=E, intermediate_size=256, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0),
                   "granitemoe", True, [("embedding_scale", 2.0), ("residual_scale", 0.5), ("attention.scale", 0.2),
                                        ("logit_scale", 3.0)]),
}


#: transformers' in-memory MoE tensors (after ``model.layers.<i>.``) -> llama.cpp's (after ``blk.<i>.``); the fused
#: ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) is cut into ``ffn_gate_exps`` and ``ffn_up_exps``.
MOE = {"mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
       "mlp.experts.down_proj": "ffn_down_exps.weight", "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
       "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
       "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
       "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}


def _tiny_moe(tmp_path_factory, tokenizer, family):
    """A 2-layer random checkpoint of ``family`` saved by ``transformers`` (eager experts), norms in [0.5, 2],
    biases N(0, 0.5), router weights N(0, 1) (well separated expert scores) and expert weights N(0, 0.1)."""
    import transformers

    cls, fields, *_ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(
        **{"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, "num_experts_per_tok": K, **fields})
    config._experts_implementation = "eager"
    hf = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "expert" in n:
                p.normal_(0, 0.1)
            elif n.endswith((".gate.weight", "router.weight", "router.layer.weight")):
                p.normal_(0, 1.0)
    path = tmp_path_factory.mktemp(family)
    tokenizer.save_pretrained(str(path))
    return _randomize(path, hf)  # norms and biases


def _gguf_tensors(hf, permute: bool):
    """llama.cpp's tensors of ``hf``: ``[(gguf name, float32 array)]``, the experts stacked ``[E, out, in]``."""
    c, out = hf.config, []
    for name, t in hf.state_dict().items():
        x = t.float().numpy()
        if name in _GGUF_TOP:
            out.append((_GGUF_TOP[name], x))
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith("experts.gate_up_proj"):
            i = x.shape[1] // 2
            out += [(f"blk.{layer}.ffn_gate_exps.weight", x[:, :i]), (f"blk.{layer}.ffn_up_exps.weight", x[:, i:])]
        elif rest.endswith("shared_expert_gate.weight"):
            out.append((f"blk.{layer}.ffn_gate_inp_shexp.weight", x.reshape(-1)))  # llama.cpp's [hidden]
        elif rest in MOE:
            out.append((f"blk.{layer}.{MOE[rest]}", x))
        else:
            module, suffix = rest.rsplit(".", 1)
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                x = _permute(x, c.num_attention_heads if "q_proj" in module else c.num_key_value_heads)
            out.append((f"blk.{layer}.{ATTN[module]}.{suffix}", x))
    return out


ROUTERS = ("mlp.gate.weight", "router.weight", "shared_expert_gate.weight")


def _qtype(name: str, x: np.ndarray, quant: str):
    """The GGUF type a tensor is written in: F32 for 1-D tensors and the router (llama.cpp keeps ``ffn_gate_inp``
    in F32), else ``quant`` (Q5_K where rows are a multiple of 256, Q8_0 otherwise, as llama.cpp falls back)."""
    import gguf

    t = gguf.GGMLQuantizationType
    if quant == "F32" or x.ndim == 1 or "ffn_gate_inp" in name or name.endswith(ROUTERS):
        return None
    if quant == "Q5_K" and x.shape[-1] % 256 == 0:
        return t.Q5_K
    return t.Q8_0


def _quantize(x: np.ndarray, q) -> np.ndarray:
    """``x`` (``[..., K]`` float32) as ``q`` blocks, ``uint8 [..., bytes per row]``."""
    import gguf

    from kvserve.quant.kquantize import quantize_q5_k

    x = np.ascontiguousarray(x, dtype=np.float32)
    if q != gguf.GGMLQuantizationType.Q5_K:
        return gguf.quants.quantize(x, q)
    return quantize_q5_k(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def _write_moe_gguf(path, hf, family, quant="F32"):
    import gguf

    _, _, arch, permute, extra = FAMILIES[family]
    c = hf.config
    w = gguf_writer(path, c, arch)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_uint32(f"{arch}.expert_count", E)
    w.add_uint32(f"{arch}.expert_used_count", K)
    for key, value in extra:
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    for name, x in _gguf_tensors(hf, permute):
        q = _qtype(name, x, quant)
        if q is None:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
        else:
            w.add_tensor(name, _quantize(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _file_values(hf, quant):
    """A copy of ``hf`` holding the weights a ``quant`` GGUF of it holds (each tensor's round trip)."""
    import gguf

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            x = p.float().numpy()
            q = _qtype(n, x, quant)
            if q is not None:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(_quantize(x, q), q).reshape(x.shape)))
    return ref


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory, tokenizer):
    return request.param, *_tiny_moe(tmp_path_factory, tokenizer, request.param)


def test_moe_family_matches_transformers(moe, tokenizer):
    """32 greedy tokens on 3 prompts and every prompt logprob within 1e-4 (float32 path), every layer a MoE."""
    family, path, hf = moe
    arch = load_model(str(path), weights_only=True).arch
    assert arch.moe is not None and arch.moe.num_experts == E and arch.moe.top_k == K
    assert all(arch.moe.sparse_layers)
    _engine_matches(path, hf, tokenizer)


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q5_K"])
def test_moe_gguf_gives_transformers_tokens(tmp_path, moe, tokenizer, quant):
    """The same weights as a llama.cpp-style GGUF: the float32 path gives the greedy tokens of transformers holding
    the file's values; the quantized path runs the file's blocks (with 15-bit activations, ``int8x2``, so what is
    left is the weights' error: logits near the float32 path's), and the C layer loop, where it runs, gives the
    Python loop's bits."""
    family, _, hf = moe
    path = _write_moe_gguf(tmp_path / f"{family}.gguf", hf, family, quant)
    model, ref = _fp32(path), _file_values(hf, quant)
    assert model.arch.moe.num_experts == E and model.spec.layers[0].mlp == "moe"
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert _greedy(model, ids) == _hf_greedy(ref, ids), prompt
    if quant == "F32":
        return
    quant_model = build_model(load_model(str(path), keep_quantized=True, weights_only=True),
                              select_backends("cpu", torch.float32, "auto", KernelConfig(quant_activations="int8x2")))
    ids = tokenizer.encode(PROMPTS[0])
    got = _logits(quant_model, ids)
    assert (got - _logits(model, ids)).abs().max().item() < 0.05
    if quant_model.fused_layers is not None:
        quant_model.fused_layers = None
        assert torch.equal(got, _logits(quant_model, ids))
