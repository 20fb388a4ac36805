"""gpt-oss family (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b; OpenAI 2025, "gpt-oss-120b & gpt-oss-20b model
card", section 2.1): a pre-norm decoder whose attention has Q/K/V/o biases, a learned sink logit per query head in
every softmax denominator (``self_attn.sinks``; Xiao et al. 2024, "Efficient streaming language models with attention
sinks"), a 128-token window on every other layer (``layer_types``, from the first) and YaRN RoPE; every MLP a mixture
of experts whose router (with a bias) takes the top-k logits, then a softmax over them, and whose experts (with
biases) apply the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)`` (``kvserve.layers.moe``: ``"swiglu_oai"``).

Its checkpoints hold each layer's experts fused and stacked, gate and up interleaved (gate at even columns):
``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]`` and ``down_proj`` ``[E, I, hidden]`` (``x @ W``: transposed from
``[out, in]``), or, as released, MXFP4 ``*_blocks`` uint8 ``[E, out, in / 32, 16]`` and ``*_scales`` ``[E, out, in /
32]`` (``formats.decode_mxfp4_hf``), which load as GGUF MXFP4 blocks (the native MX4 kernel; exact: the same codes and
exponents); biases ``*_bias`` ``[E, out]``; the router ``mlp.router.{weight,bias}``. ``moe_weights`` renames them to
the decoder's stacked ``[E, out, in]`` names (``DecoderModel._moe``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, MOE_FIELDS, Experts, Family, layer_types_window
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router
from kvserve.quant import QuantTensor
from kvserve.quant import formats


def mxfp4_tensor(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    """Hugging Face MXFP4 ``blocks`` uint8 ``[E, N, K / 32, 16]`` and ``scales`` ``[E, N, K / 32]`` -> a stacked GGUF
    MXFP4 ``QuantTensor`` ``[E * N, K]`` (``experts = E``; per 32 values the E8M0 byte, then 16 bytes holding values
    ``j`` and ``j + 16`` in the low and high nibbles of byte ``j``, as ggml's ``block_mxfp4``): the same codes and
    exponents, re-laid (``formats.decode_mxfp4_hf``).

    Raises:
        ValueError: shapes that do not match."""
    codes, e = formats.decode_mxfp4_hf(blocks.numpy(), scales.numpy())  # [E, N, K], [E, N, K/32]
    n_exp, n, k = codes.shape
    c = codes.reshape(n_exp, n, k // 32, 32)
    raw = np.concatenate([e[..., None], c[..., :16] | (c[..., 16:] << 4)], axis=-1)  # [E, N, K/32, 17]
    return QuantTensor(name, formats.MXFP4, np.ascontiguousarray(raw.reshape(n_exp * n, -1)), (n_exp * n, k),
                       experts=n_exp)


def _rows(w, start: int, name: str):
    """Every other output row of stacked experts from ``start`` (gate: 0, up: 1): ``[E, out, in]`` float or
    ``(blocks, scales)`` -> float ``[E, out / 2, in]`` or a stacked MXFP4 ``QuantTensor``."""
    if isinstance(w, tuple):
        blocks, scales = w
        return mxfp4_tensor(name, blocks[:, start::2].contiguous(), scales[:, start::2].contiguous())
    return w[:, start::2]


def moe_weights(weights: dict) -> dict:
    """``weights`` with gpt-oss's MoE tensors under the decoder's names: ``mlp.gate.{weight,bias}``, the stacked
    ``mlp.experts.{gate,up,down}_proj.{weight,bias}`` (float ``[E, out, in]`` or MXFP4 ``QuantTensor``), gate and
    up rows split from the interleaved fused projection; others unchanged.

    Raises:
        ValueError: an MXFP4 tensor whose blocks or scales are missing."""
    out, packed = {}, {}
    for name, w in weights.items():
        if name.endswith("self_attn.sinks.weight"):  # (GGUF: attn_sinks.weight)
            out[name[: -len(".weight")]] = w
            continue
        if ".mlp." not in name or ".mlp.experts." in name and name.endswith((".weight", ".bias")):
            out[name] = w  # (GGUF: the experts already stacked [E, out, in], gate and up apart)
            continue
        p, rest = name.split("mlp.", 1)
        if rest.startswith("router."):
            out[p + "mlp.gate." + rest.split(".", 1)[1]] = w
        elif rest.endswith(("_blocks", "_scales")):
            base, kind = rest.rsplit("_", 1)
            packed.setdefault(p + "mlp." + base, {})[kind] = w
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            packed[p + "mlp." + rest] = {"float": w.transpose(1, 2)}
        elif rest == "experts.gate_up_proj_bias":
            out[p + "mlp.experts.gate_proj.bias"], out[p + "mlp.experts.up_proj.bias"] = w[:, 0::2], w[:, 1::2]
        elif rest == "experts.down_proj_bias":
            out[p + "mlp.experts.down_proj.bias"] = w
        else:
            out[name] = w
    for name, parts in packed.items():
        if "float" in parts:
            w = parts["float"]
        elif set(parts) == {"blocks", "scales"}:
            w = (parts["blocks"], parts["scales"])
        else:
            raise ValueError(f"gpt-oss MXFP4 weight {name} needs {name}_blocks and {name}_scales; got {sorted(parts)}")
        p = name.split("mlp.", 1)[0] + "mlp.experts."
        if name.endswith("gate_up_proj"):
            out[p + "gate_proj.weight"] = _rows(w, 0, p + "gate_proj.weight")
            out[p + "up_proj.weight"] = _rows(w, 1, p + "up_proj.weight")
        else:
            out[p + "down_proj.weight"] = (mxfp4_tensor(p + "down_proj.weight", *w) if isinstance(w, tuple) else w)
    return out


class GptOssModel(DecoderModel):
    """``DecoderModel`` over gpt-oss's names (``moe_weights``), reading ``self_attn.sinks`` ``[H_q]`` per layer."""

    def __init__(self, arch: ModelArch, weights: dict, backends: ModelBackends):
        super().__init__(arch, moe_weights(weights), backends)

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        m = arch.moe
        return llama_spec(arch, router=moe_router(arch, "topk_softmax"), attention_sinks=True,
                          expert_activation="swiglu_oai", expert_alpha=m.swiglu_alpha, expert_limit=m.swiglu_limit,
                          expert_bias=True)


def read_config(cfg: dict, architecture: str, where: str) -> dict:
    """``ModelArch``'s ``sliding_window`` and ``layer_types`` of a gpt-oss config: the window on the layers of
    ``layer_types``, by default every other one from the first (transformers' default)."""
    return layer_types_window(cfg.get("sliding_window"), cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(cfg["num_hidden_layers"])])


#: ``hidden_act`` is not read by the experts (their activation is the clamped SwiGLU); Q/K/V and o_proj biases
#: (``attention_bias``); the window on the ``layer_types`` layers; the top-k-then-softmax weights sum to 1.
#: llama.cpp's ``gpt-oss``: the pre-MLP norm is ``post_attention_norm``, the sinks ``attn_sinks``, every tensor of
#: the MoE with a ``.bias`` beside its weight, the window on every other layer from the first (its fixed pattern),
#: the clamped SwiGLU's constants fixed at 1.702 and 7.0, YaRN from ``rope.scaling.*`` (llama.cpp's: the
#: correction range truncated to whole dimensions).
FAMILY = Family(GptOssModel, {"GptOssForCausalLM": {
    **MOE_FIELDS, "hidden_act": ("silu",), "attention_bias": (True,), "sliding_window": None, "layer_types": None,
    "swiglu_alpha": None, "swiglu_limit": None}},
    gguf_architectures={"gpt-oss": "GptOssForCausalLM"},
    gguf_layer_names={"gpt-oss": {**GGUF_MOE_NAMES, "attn_sinks": "self_attn.sinks",
                                  "post_attention_norm": "post_attention_layernorm", "ffn_norm": None}},
    experts=Experts(renormalize=False, gguf={"gpt-oss": False}), gguf_window_pattern={"gpt-oss": 2},
    read_config=read_config, chat_format="harmony")
