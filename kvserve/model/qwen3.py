"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder with every query and key head RMS-normed over its width
before RoPE (Qwen3 technical report, Yang et al. 2025, section 2: QK-Norm in place of Qwen2's Q/K/V biases, which
``attention_bias`` can still turn on). ``ModelArch.qk_norm`` carries it; ``LlamaModel`` applies it in its layer
loop (the fused C loop does not, so such models run the Python loop)."""

from __future__ import annotations

from kvserve.model.llama import LlamaModel


class Qwen3Model(LlamaModel):
    """``LlamaModel`` reading ``self_attn.{q,k}_norm.weight`` (``[head_dim]``) per layer."""
