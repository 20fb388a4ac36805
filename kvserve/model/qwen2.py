"""Qwen2 family (Qwen2ForCausalLM): the Llama decoder with a bias on the Q, K and V projections
(Qwen2 technical report, Yang et al. 2024, §2.1). Sliding-window attention is not supported (configs that enable
it are refused by the loader)."""

from __future__ import annotations

from kvserve.model.llama import LlamaModel


class Qwen2Model(LlamaModel):
    """``LlamaModel`` whose fused QKV projection requires ``self_attn.{q,k,v}_proj.bias``."""

    qkv_bias = True
