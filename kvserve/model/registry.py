"""The model families, one line each, and ``build_model``.

A family is one module (``kvserve/model/<family>.py``) holding its model class and its ``FAMILY`` declaration
(``kvserve.model.family.Family``: Hugging Face and GGUF architecture names, the config fields it implements, its
GGUF weight names, the hooks reading its own config and metadata); adding a family is that module plus its line in
``FAMILY_MODULES``
(``tests/model/test_family_files.py`` checks that no other module names its architectures).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from kvserve.model.backends import ModelBackends
from kvserve.model.base import CausalLM

#: The family modules, one line each (the order of ``SUPPORTED_ARCHITECTURES``).
FAMILY_MODULES = (
    "kvserve.model.llama",
    "kvserve.model.qwen2",
    "kvserve.model.qwen3",
    "kvserve.model.mistral",
    "kvserve.model.granite",
    "kvserve.model.smollm3",
    "kvserve.model.phi3",
    "kvserve.model.olmo2",
    "kvserve.model.gemma",  # Gemma 2 and Gemma 3 (text)
    "kvserve.model.qwen3_moe",
    "kvserve.model.olmoe",
    "kvserve.model.mixtral",
    "kvserve.model.qwen2_moe",
    "kvserve.model.granite_moe",
    "kvserve.model.gpt_oss",
)
#: module -> its ``Family``.
FAMILIES = {m: importlib.import_module(m).FAMILY for m in FAMILY_MODULES}
#: Hugging Face architecture name -> its ``Family``.
FAMILY_OF = {a: f for f in FAMILIES.values() for a in f.architectures}
#: Hugging Face architecture name -> model class.
_MODELS = {a: f.model for a, f in FAMILY_OF.items()}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)
#: Per Hugging Face architecture: the math-changing config fields it implements -> the values it takes
#: (``hf_config.check_fields``).
FAMILY_FIELDS = {a: fields for f in FAMILIES.values() for a, fields in f.config_fields.items()}
#: GGUF ``general.architecture`` values read, and the Hugging Face architecture each loads as.
GGUF_ARCHITECTURES = {g: a for f in FAMILIES.values() for g, a in f.gguf_architectures.items()}
#: GGUF architectures read with ``<arch>.expert_count`` -> (the Hugging Face architecture such a file loads as,
#: whether llama.cpp's graph renormalizes the chosen experts' weights): ``family.Experts.gguf``.
GGUF_EXPERTS = {g: (f.architectures[0], renorm) for f in FAMILIES.values() if f.experts
                for g, renorm in f.experts.gguf.items()}
#: GGUF architectures whose ``attention.sliding_window`` is read -> ``n``: it covers every layer but each ``n``-th;
#: ``None``: every layer (``family.Family.gguf_window_pattern``).
GGUF_WINDOW_PATTERNS = {g: n for f in FAMILIES.values() for g, n in f.gguf_window_pattern.items()}
#: Multimodal Hugging Face architectures whose text model a family runs -> its ``family.TextPart``.
TEXT_PARTS = {m: part for f in FAMILIES.values() for m, part in f.text_parts.items()}
#: GGUF architectures whose Q/K rows llama.cpp's converter permutes for its interleaved RoPE (its rope type
#: "norm"); the others (Qwen2: "neox") keep Hugging Face's rotate-half rows.
GGUF_PERMUTED_QK = tuple(dict.fromkeys(g for f in FAMILIES.values() for g in f.gguf_permuted_qk))


def model_class(architecture: str) -> type:
    """The class implementing ``architecture``.

    Raises:
        ValueError: an architecture not in ``SUPPORTED_ARCHITECTURES``.
    """
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
    return _MODELS[architecture]


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
