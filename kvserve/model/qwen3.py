"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder with every query and key head RMS-normed over its width
before RoPE (Qwen3 technical report, Yang et al. 2025, section 2: QK-Norm in place of Qwen2's Q/K/V biases, which
``attention_bias`` can still turn on): ``LayerSpec.qk_norm = "head"``."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec
from kvserve.model.qwen2 import QWEN_WINDOW, qwen_window

#: llama.cpp's per-head Q/K norm tensors (also read by Gemma 3).
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3Model(DecoderModel):
    """``DecoderModel`` reading ``self_attn.{q,k}_norm.weight`` (``[head_dim]``) per layer."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qk_norm="head")


FAMILY = Family(Qwen3Model, {"Qwen3ForCausalLM": {**ANY_ACTIVATION, "attention_bias": (False, True), **QWEN_WINDOW}},
                gguf_architectures={"qwen3": "Qwen3ForCausalLM"}, gguf_layer_names={"qwen3": QK_NORM_NAMES},
                read_config=lambda cfg, architecture, where: qwen_window(cfg))
