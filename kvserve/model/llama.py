"""Llama family (LlamaForCausalLM; Touvron et al. 2023; Llama 3.x's RoPE scaling) and Mistral (MistralForCausalLM:
Llama's math, v0.1 with a sliding window on every layer): the decoder as ``kvserve.model.decoder`` runs it by
default -- two pre-norms, SwiGLU (or GELU-gated with ``hidden_act``), optional ``attention_bias`` / ``mlp_bias``."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel


class LlamaModel(DecoderModel):
    """``DecoderModel`` with Llama's spec (``layer_spec.llama_spec``)."""
