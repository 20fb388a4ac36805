"""Granite family (GraniteForCausalLM, IBM Granite 3.x): the Llama decoder with four scalars (Granite 3.0 report,
IBM 2024): the embeddings multiplied by ``embedding_multiplier``, each attention and MLP output by
``residual_multiplier`` before its residual add, the softmax scale ``attention_multiplier`` in place of
``head_dim ** -0.5``, and the logits divided by ``logits_scaling`` (``DecoderSpec``'s scalars)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, LLAMA_BIASES, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec


@dataclass(frozen=True)
class GraniteArch(ModelArch):
    """``ModelArch`` plus Granite's multipliers (Granite, Granite-MoE; its ``attention_multiplier`` is
    ``ModelArch``'s softmax scale).

    Attributes:
        embedding_multiplier: the embeddings are multiplied by it.
        residual_multiplier: each sub-layer's output is multiplied by it before its residual add.
        logits_scaling: the logits are divided by it.
    """

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def multipliers(arch: GraniteArch) -> dict:
    """``DecoderSpec``'s fields of Granite's multipliers (for ``layer_spec.llama_spec``)."""
    return dict(embedding_multiplier=arch.embedding_multiplier, residual_multiplier=arch.residual_multiplier,
                logits_divisor=arch.logits_scaling)


#: Granite's scalars in a GGUF: ``<arch>.`` key -> ``ModelArch`` field.
GGUF_SCALARS = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
#: Granite's four config fields (every one read: ``read_config``).
SCALAR_FIELDS = {"embedding_multiplier": None, "residual_multiplier": None, "attention_multiplier": None,
                 "logits_scaling": None}


def read_config(cfg: dict, architecture: str, where: str) -> dict:
    """Granite's four scalars from a config (absent: 1.0)."""
    return {name: float(cfg.get(name, 1.0)) for name in SCALAR_FIELDS}


def read_gguf(field, a: str, common: dict) -> dict:
    """Granite's scalars from a GGUF's ``GGUF_SCALARS`` keys (absent: ``GraniteArch``'s defaults)."""
    return {f: float(field(f"{a}.{k}")) for k, f in GGUF_SCALARS.items() if field(f"{a}.{k}") is not None}


class GraniteModel(DecoderModel):
    """``DecoderModel`` with Granite's multipliers (``DecoderSpec``'s scalars)."""

    @classmethod
    def spec(cls, arch: GraniteArch) -> DecoderSpec:
        return llama_spec(arch, **multipliers(arch))


FAMILY = Family(GraniteModel, {"GraniteForCausalLM": {**ANY_ACTIVATION, **LLAMA_BIASES, **SCALAR_FIELDS}},
                gguf_architectures={"granite": "GraniteForCausalLM"}, gguf_permuted_qk=("granite",),
                arch_class=GraniteArch, read_config=read_config, read_gguf=read_gguf,
                gguf_keys={"granite": tuple(GGUF_SCALARS)})
