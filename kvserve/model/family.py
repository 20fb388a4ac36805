"""What a model family module declares (``FAMILY``), read by the registry, the config reader and the GGUF loader.

A family is one module (``kvserve/model/<family>.py``) holding its model class (a ``DecoderModel`` with its
``DecoderSpec``: ``kvserve.model.layer_spec``) and one ``Family`` record: its Hugging Face and GGUF architecture
names, the math-changing config fields it implements (every other such field is refused by name:
``hf_config.check_fields``) and its GGUF weight map (llama.cpp's per-layer tensor names -> Hugging Face's, where
they differ from the common table). ``kvserve.model.registry`` lists the family modules, one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvserve.model.layer_spec import ACTIVATIONS


@dataclass(frozen=True)
class Family:
    """One family's declaration.

    Attributes:
        model: the model class (a ``DecoderModel`` subclass).
        config_fields: Hugging Face architecture name -> the math-changing ``config.json`` fields it implements ->
            the values it takes (``None``: any value of the field's type, read by the config reader).
        gguf_architectures: llama.cpp ``general.architecture`` -> the Hugging Face architecture it loads as.
        gguf_layer_names: llama.cpp ``general.architecture`` -> per-layer tensor kinds beyond (or absent from:
            ``None``) the common table (``loader._GGUF_LAYER_NAMES``) -> Hugging Face module names.
        gguf_permuted_qk: the GGUF architectures whose Q/K rows llama.cpp's converter permutes for its
            interleaved RoPE (its rope type "norm"), unpermuted at load.
    """

    model: type
    config_fields: dict
    gguf_architectures: dict = field(default_factory=dict)
    gguf_layer_names: dict = field(default_factory=dict)
    gguf_permuted_qk: tuple = ()

    def __post_init__(self) -> None:
        unknown = {g: a for g, a in self.gguf_architectures.items() if a not in self.config_fields}
        if unknown:
            raise ValueError(f"GGUF architectures {unknown} load as architectures this family does not declare")

    @property
    def architectures(self) -> tuple:
        """The Hugging Face architecture names of this family."""
        return tuple(self.config_fields)


#: The ``hidden_act`` values every family takes.
ANY_ACTIVATION = {"hidden_act": ACTIVATIONS}
#: Llama's biases (``attention_bias``: Q/K/V and o_proj; ``mlp_bias``), as a config field table.
LLAMA_BIASES = {"attention_bias": (False, True), "mlp_bias": (False, True)}


def layer_names(family: Family, gguf_arch: str, common: dict) -> dict:
    """llama.cpp per-layer tensor kind -> Hugging Face module name for ``gguf_arch``: ``common`` with the family's
    own entries over it (``None`` entries removed)."""
    return {k: v for k, v in {**common, **family.gguf_layer_names.get(gguf_arch, {})}.items() if v}


def find(families: dict, architecture: str) -> Optional[Family]:
    """The family (of ``families``: module -> ``Family``) declaring Hugging Face ``architecture``, or ``None``."""
    return next((f for f in families.values() if architecture in f.config_fields), None)
