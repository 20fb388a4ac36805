"""Phi-3 family (Phi3ForCausalLM: Phi-3, Phi-3.5-mini, Phi-4-mini; Abdin et al. 2024, "Phi-3 Technical Report"):
the Llama decoder with the Q/K/V projections stored as one ``qkv_proj`` and the gate and up projections as one
``gate_up_proj`` (gate rows first), LongRoPE (``kvserve.layers.rotary``) and, in Phi-4-mini, partial rotary
(``partial_rotary_factor``). The fused weights are cut back into Llama's parts (views, or row selections of a GGUF
block tensor: nothing is dequantized), and for partial rotary each head's Q and K rows are reordered so the
full-width RoPE kernels rotate exactly the features Hugging Face rotates (``partial_rotary_rows``); then it is
Llama's decoder, fused C layer loop included."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvserve.layers.rotary import partial_rotary_rows
from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family
from kvserve.quant.gguf_io import QuantTensor


class Phi3Model(DecoderModel):
    """``DecoderModel`` over Phi-3's weights: ``self_attn.qkv_proj.weight`` ``[(H_q + 2 H_kv) D, hidden]`` and
    ``mlp.gate_up_proj.weight`` ``[2 I, hidden]`` (Hugging Face names; GGUF ``attn_qkv``, ``ffn_up``), or already
    separate Q/K/V (llama.cpp may write ``attn_q``/``attn_k``/``attn_v``)."""

    def __init__(self, arch: ModelArch, weights: dict, backends: ModelBackends):
        super().__init__(arch, llama_weights(arch, weights), backends)


def read_config(cfg: dict, architecture: str, where: str) -> dict:
    """``ModelArch.sliding_window`` of a Phi-3 config: its window on every layer, as Mistral's; none for a window
    covering the whole context (``max_position_embeddings``: no token is ever outside it)."""
    window = cfg.get("sliding_window")
    return {} if window is None or window >= cfg.get("max_position_embeddings", 2048) else {"sliding_window": window}


#: Fused Q/K/V (or separate), gate and up in one ``ffn_up`` (gate rows first), as Hugging Face's ``gate_up_proj``;
#: LongRoPE (older configs call it ``su`` or ``yarn``, read as transformers' ``Phi3Config`` reads them; llama.cpp's
#: ``rope_factors_long`` / ``rope_factors_short``), partial rotary and a window on every layer.
FAMILY = Family(Phi3Model, {"Phi3ForCausalLM": {**ANY_ACTIVATION, "partial_rotary_factor": None,
                                                "sliding_window": None}},
                gguf_architectures={"phi3": "Phi3ForCausalLM"},
                gguf_layer_names={"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
                                           "ffn_gate": None}},
                read_config=read_config, rope_type_aliases={"su": "longrope", "yarn": "longrope"},
                gguf_window_pattern={"phi3": None},
                gguf_model_tensors={"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")})


def _rows(w, start: int, stop: int, index=None, tag: str = ""):
    """Rows ``start:stop`` of ``w`` (then reordered by ``index`` within them): a view of a float tensor, or a
    ``QuantTensor`` row selection named after its source and the selection (the packed-weight cache's key)."""
    idx = np.arange(start, stop) if index is None else start + np.asarray(index)
    if isinstance(w, QuantTensor):
        return dataclasses.replace(w.take_rows(idx), name=f"{w.name}[{start}:{stop}{tag}]")
    return w[start:stop] if index is None else w[torch.as_tensor(idx)]


def llama_weights(arch: ModelArch, weights: dict) -> dict:
    """``weights`` with each layer's ``qkv_proj`` and ``gate_up_proj`` split into Llama's names, and, with a
    ``partial_rotary_factor`` below 1, the Q and K rows of every head in ``partial_rotary_rows`` order (biases
    too). Other tensors are passed through."""
    d, nq, nkv, inter = arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    s = arch.rope_scaling
    order, tag = None, ""
    if s is not None and s.partial_rotary_factor != 1.0:
        rot = int(d * s.partial_rotary_factor)
        order, tag = partial_rotary_rows(d, rot), f" rot{rot}"
    out = {}
    for name, w in weights.items():
        if ".self_attn.qkv_proj." in name:
            p, suffix = name.split("self_attn.qkv_proj.")
            q, k = nq * d, (nq + nkv) * d
            for part, (a, b) in zip("qkv", ((0, q), (q, k), (k, k + nkv * d))):
                out[f"{p}self_attn.{part}_proj.{suffix}"] = _rows(w, a, b)
        elif ".mlp.gate_up_proj." in name:
            p, suffix = name.split("mlp.gate_up_proj.")
            out[f"{p}mlp.gate_proj.{suffix}"] = _rows(w, 0, inter)
            out[f"{p}mlp.up_proj.{suffix}"] = _rows(w, inter, 2 * inter)
        else:
            out[name] = w
    if order is not None:
        for name in [n for n in out if ".self_attn.q_proj." in n or ".self_attn.k_proj." in n]:
            heads = nq if ".q_proj." in name else nkv
            index = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
            out[name] = _rows(out[name], 0, heads * d, index, tag)
    return out
