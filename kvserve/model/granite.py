"""Granite family (GraniteForCausalLM, IBM Granite 3.x): the Llama decoder with four scalars (Granite 3.0 report,
IBM 2024): the embeddings multiplied by ``embedding_multiplier``, each attention and MLP output by
``residual_multiplier`` before its residual add, the softmax scale ``attention_multiplier`` in place of
``head_dim ** -0.5``, and the logits divided by ``logits_scaling``. ``ModelArch`` carries them and ``LlamaModel``
applies them (the fused C loop does not, so these models run the Python loop)."""

from __future__ import annotations

from kvserve.model.llama import LlamaModel


class GraniteModel(LlamaModel):
    """``LlamaModel`` with Granite's multipliers (``ModelArch.embedding_multiplier`` and the others)."""
