"""Architecture name -> model class, and ``build_model``. One line per model family."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from kvserve.model.backends import ModelBackends
from kvserve.model.base import CausalLM

#: Hugging Face architecture name -> ``"module:Class"`` (imported on first use).
_MODELS = {
    "LlamaForCausalLM": "kvserve.model.llama:LlamaModel",
    "Qwen2ForCausalLM": "kvserve.model.qwen2:Qwen2Model",
    "Qwen3ForCausalLM": "kvserve.model.qwen3:Qwen3Model",
    "MistralForCausalLM": "kvserve.model.llama:LlamaModel",  # Llama's math with v0.1's sliding window
    "GraniteForCausalLM": "kvserve.model.granite:GraniteModel",
    "SmolLM3ForCausalLM": "kvserve.model.smollm3:SmolLM3Model",
    "Phi3ForCausalLM": "kvserve.model.phi3:Phi3Model",
    "Olmo2ForCausalLM": "kvserve.model.olmo2:Olmo2Model",
    "Gemma2ForCausalLM": "kvserve.model.gemma:GemmaModel",
    "Gemma3ForCausalLM": "kvserve.model.gemma:GemmaModel",  # the text model (Gemma 3 1B, or a text-only export)
    "Qwen3MoeForCausalLM": "kvserve.model.qwen3_moe:Qwen3MoeModel",
    "OlmoeForCausalLM": "kvserve.model.olmoe:OlmoeModel",
    "MixtralForCausalLM": "kvserve.model.mixtral:MixtralModel",
    "Qwen2MoeForCausalLM": "kvserve.model.qwen2_moe:Qwen2MoeModel",
    "GraniteMoeForCausalLM": "kvserve.model.granite_moe:GraniteMoeModel",
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def model_class(architecture: str) -> type:
    """The class implementing ``architecture``.

    Raises:
        ValueError: an architecture not in ``SUPPORTED_ARCHITECTURES``.
    """
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)


def build_model(loaded, backends: ModelBackends, max_model_len: Optional[int] = None) -> CausalLM:
    """Build the model of a ``LoadedModel`` (``kvserve.model.loader``) with the chosen backends.

    ``loaded.weights`` is read, not consumed: fused copies are made (several engines in one process share a load).
    Quantized projections are served from ``loaded.weight_cache`` (packed once, on disk) when the load has one.
    ``max_model_len``: the engine's serving length (``None``: the model's context), which fixes the RoPE schemes
    that depend on it (dynamic NTK, LongRoPE: ``kvserve.layers.rotary``).
    """
    cls = model_class(loaded.arch.architecture)
    arch = loaded.arch
    if arch.rope_scaling is not None and arch.rope_scaling.depends_on_max_model_len:
        arch = dataclasses.replace(arch, rope_scaling=arch.rope_scaling.for_max_model_len(max_model_len))
    cache = getattr(loaded, "weight_cache", None)
    if cache is None or backends.quantization == "fp32":
        return cls(arch, loaded.weights, backends)
    return cache.build_model(lambda b: cls(arch, loaded.weights, b), backends)
