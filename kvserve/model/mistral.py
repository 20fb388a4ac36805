"""Mistral family (MistralForCausalLM): Llama's math, with Mistral 7B v0.1's sliding window (4096) on every layer
(v0.2+: none). llama.cpp converts these models as ``llama`` (``kvserve.model.llama``)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family


def every_layer_window(cfg: dict, architecture: str, where: str) -> dict:
    """``ModelArch.sliding_window``: the config's ``sliding_window`` on every layer (transformers ignores a Mistral's
    ``layer_types``; ``hf_config.check_fields`` refuses one that is not all full)."""
    return {"sliding_window": cfg.get("sliding_window")}


class MistralModel(DecoderModel):
    """``DecoderModel`` with Llama's spec and the window of ``sliding_window`` on every layer."""


FAMILY = Family(MistralModel, {"MistralForCausalLM": {**ANY_ACTIVATION, "sliding_window": None}},
                read_config=every_layer_window)
