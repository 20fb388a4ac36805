"""Granite family (GraniteForCausalLM, IBM Granite 3.x): the Llama decoder with four scalars (Granite 3.0 report,
IBM 2024): the embeddings multiplied by ``embedding_multiplier``, each attention and MLP output by
``residual_multiplier`` before its residual add, the softmax scale ``attention_multiplier`` in place of
``head_dim ** -0.5``, and the logits divided by ``logits_scaling`` (``DecoderSpec``'s scalars)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel


class GraniteModel(DecoderModel):
    """``DecoderModel`` with Granite's multipliers (``layer_spec.llama_spec`` reads them from the ``ModelArch``)."""
