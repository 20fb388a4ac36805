"""Mixtral family (MixtralForCausalLM: Mixtral 8x7B / 8x22B; Jiang et al. 2024, "Mixtral of experts", section 2):
Mistral's decoder (a window on every layer when ``sliding_window`` is set) with every MLP a mixture of 8 experts, 2
per token: softmax router, top-k, always renormalized. Its checkpoints name the router ``block_sparse_moe.gate`` and
each expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down); llama.cpp writes it as ``llama`` with
``llama.expert_count``."""

from __future__ import annotations

from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, MOE_FIELDS, Experts, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router
from kvserve.model.mistral import every_layer_window

#: Mixtral's MoE tensor names -> the decoder's (Qwen-MoE's: ``DecoderModel._moe``).
_NAMES = {"block_sparse_moe.gate.": "mlp.gate.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj.",
          "block_sparse_moe.experts.": "mlp.experts."}


def rename(name: str) -> str:
    """A Mixtral tensor name as the decoder reads it (others unchanged)."""
    if "block_sparse_moe." not in name:
        return name
    for old, new in _NAMES.items():
        name = name.replace(old, new)
    return name


class MixtralModel(DecoderModel):
    """``DecoderModel`` over Mixtral's names (``rename``; GGUF ``ffn_gate_inp`` and ``ffn_*_exps`` load as the
    decoder's names already)."""

    def __init__(self, arch: ModelArch, weights: dict, backends: ModelBackends):
        super().__init__(arch, {rename(k): w for k, w in weights.items()}, backends)

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, router=moe_router(arch))


#: Mistral's window; always renormalized. llama.cpp writes Mixtral as ``llama`` with ``llama.expert_count`` (its
#: graph renormalizes).
FAMILY = Family(MixtralModel, {"MixtralForCausalLM": {**MOE_FIELDS, "hidden_act": ("silu",), "sliding_window": None}},
                gguf_layer_names={"llama": GGUF_MOE_NAMES}, experts=Experts(renormalize=True, gguf={"llama": True}),
                read_config=every_layer_window)
