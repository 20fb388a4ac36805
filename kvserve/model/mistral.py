"""Mistral family (MistralForCausalLM): Llama's math, with Mistral 7B v0.1's sliding window (4096) on every layer
(v0.2+: none). llama.cpp converts these models as ``llama`` (``kvserve.model.llama``)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family


class MistralModel(DecoderModel):
    """``DecoderModel`` with Llama's spec and the window of ``sliding_window`` on every layer."""


FAMILY = Family(MistralModel, {"MistralForCausalLM": {**ANY_ACTIVATION, "sliding_window": None}})
