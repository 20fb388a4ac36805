"""Llama family (LlamaForCausalLM; Touvron et al. 2023; Llama 3.x's RoPE scaling; llama.cpp's ``llama``, which
also holds Mistral 7B v0.1 with its window): the decoder as ``kvserve.model.decoder`` runs it by default -- two
pre-norms, SwiGLU (or GELU-gated with ``hidden_act``), optional ``attention_bias`` / ``mlp_bias``."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, LLAMA_BIASES, Family


class LlamaModel(DecoderModel):
    """``DecoderModel`` with Llama's spec (``layer_spec.llama_spec``)."""


#: llama.cpp's ``llama`` also holds Mistral 7B v0.1: its ``attention.sliding_window`` on every layer.
FAMILY = Family(LlamaModel, {"LlamaForCausalLM": {**ANY_ACTIVATION, **LLAMA_BIASES}},
                gguf_architectures={"llama": "LlamaForCausalLM"}, gguf_permuted_qk=("llama",),
                gguf_window_pattern={"llama": None})
