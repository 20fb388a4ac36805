"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder with every query and key head RMS-normed over its width
before RoPE (Qwen3 technical report, Yang et al. 2025, section 2: QK-Norm in place of Qwen2's Q/K/V biases, which
``attention_bias`` can still turn on): ``LayerSpec.qk_norm = "head"``."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.layer_spec import DecoderSpec, llama_spec


class Qwen3Model(DecoderModel):
    """``DecoderModel`` reading ``self_attn.{q,k}_norm.weight`` (``[head_dim]``) per layer."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qk_norm="head")
