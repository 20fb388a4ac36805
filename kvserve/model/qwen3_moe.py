"""Qwen3-MoE family (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B; Qwen3 technical report, Yang et al.
2025, section 2): Qwen3's decoder (per-head Q/K RMSNorm) with a mixture-of-experts MLP -- a softmax router over
``num_experts``, the ``num_experts_per_tok`` largest probabilities, renormalized when ``norm_topk_prob`` (llama.cpp's
``qwen3moe`` always renormalizes), no shared expert -- on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
make sparse (the others dense)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, Experts, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router
from kvserve.model.qwen2_moe import QWEN_MOE_FIELDS
from kvserve.model.qwen3 import QK_NORM_NAMES


class Qwen3MoeModel(DecoderModel):
    """``DecoderModel`` reading ``self_attn.{q,k}_norm.weight`` (``[head_dim]``), ``mlp.gate.weight`` and
    ``mlp.experts.<e>.{gate,up,down}_proj.weight`` per sparse layer (GGUF: ``ffn_gate_inp``, ``ffn_*_exps``)."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qk_norm="head", router=moe_router(arch))


#: llama.cpp's ``qwen3moe`` always renormalizes.
FAMILY = Family(Qwen3MoeModel, {"Qwen3MoeForCausalLM": {**QWEN_MOE_FIELDS, "attention_bias": (False, True)}},
                gguf_architectures={"qwen3moe": "Qwen3MoeForCausalLM"},
                gguf_layer_names={"qwen3moe": {**QK_NORM_NAMES, **GGUF_MOE_NAMES}},
                experts=Experts(renormalize=None, gguf={"qwen3moe": True}))
