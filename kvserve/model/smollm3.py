"""SmolLM3 family (SmolLM3ForCausalLM): the Llama decoder in which some layers apply no RoPE ("NoPE", one layer in
four by default: Hugging Face's SmolLM3 release; Kazemnejad et al. 2023 on NoPE): ``LayerSpec.rope = None`` on
those layers (``SmolLM3Arch.no_rope_layers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, LLAMA_BIASES, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec


@dataclass(frozen=True)
class SmolLM3Arch(ModelArch):
    """``ModelArch`` plus SmolLM3's NoPE layers.

    Attributes:
        no_rope_layers: per layer, 1 where it applies RoPE and 0 where it does not; ``None``: every layer does.

    Raises:
        ValueError: ``no_rope_layers`` not one entry per layer.
    """

    no_rope_layers: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(self.no_rope_layers)} entries for {self.num_hidden_layers} "
                             f"layers")
        super().__post_init__()


class SmolLM3Model(DecoderModel):
    """``DecoderModel`` with SmolLM3's NoPE layers (``LayerSpec.rope = None`` on them)."""

    @classmethod
    def spec(cls, arch: SmolLM3Arch) -> DecoderSpec:
        nope = arch.no_rope_layers or (1,) * arch.num_hidden_layers
        return llama_spec(arch, layer_ropes=tuple(0 if rope else None for rope in nope))


#: llama.cpp's SmolLM3: every 4th layer applies no RoPE (a constant in llama.cpp, no GGUF key; Hugging Face's
#: default ``no_rope_layer_interval``).
GGUF_NOPE_STEP = 4


def read_config(cfg: dict, architecture: str, where: str) -> dict:
    """``SmolLM3Arch.no_rope_layers`` of a SmolLM3 config (its ``no_rope_layers``; ``None``: RoPE on every layer)."""
    layers = cfg.get("no_rope_layers")
    return {"no_rope_layers": tuple(int(x) for x in layers) if layers else None}


def read_gguf(field, a: str, common: dict) -> dict:
    """``SmolLM3Arch.no_rope_layers`` of a ``smollm3`` GGUF: llama.cpp's fixed pattern (``GGUF_NOPE_STEP``)."""
    return {"no_rope_layers": tuple(int((i + 1) % GGUF_NOPE_STEP != 0) for i in range(common["num_hidden_layers"]))}


FAMILY = Family(SmolLM3Model, {"SmolLM3ForCausalLM": {
    **ANY_ACTIVATION, **LLAMA_BIASES, "use_sliding_window": (False,), "no_rope_layers": None,
    "no_rope_layer_interval": None}},
    gguf_architectures={"smollm3": "SmolLM3ForCausalLM"}, gguf_permuted_qk=("smollm3",), arch_class=SmolLM3Arch,
    read_config=read_config, read_gguf=read_gguf)
