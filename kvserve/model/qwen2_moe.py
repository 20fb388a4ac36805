"""Qwen2-MoE family (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Qwen2 technical report, Yang et al.
2024, section 2.2.2): Qwen2's decoder (Q/K/V biases) with a mixture-of-experts MLP -- a softmax router, top-k,
renormalized only when ``norm_topk_prob`` (llama.cpp's ``qwen2moe`` never) -- plus a shared expert every token runs,
scaled by ``sigmoid(shared_expert_gate(x))``, on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` make
sparse."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, MOE_FIELDS, Experts, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router

#: Qwen2-MoE / Qwen3-MoE's expert fields (SiLU experts; a window is refused: ``use_sliding_window`` off).
QWEN_MOE_FIELDS = {**MOE_FIELDS, "hidden_act": ("silu",), "moe_intermediate_size": None,
                   "norm_topk_prob": (False, True), "decoder_sparse_step": None, "mlp_only_layers": None,
                   "use_sliding_window": (False,), "sliding_window": None, "max_window_layers": None}


class Qwen2MoeModel(DecoderModel):
    """``DecoderModel`` reading ``mlp.gate``, ``mlp.experts.<e>.*``, ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate`` per sparse layer (GGUF: ``ffn_gate_inp``, ``ffn_*_exps``, ``ffn_*_shexp``,
    ``ffn_gate_inp_shexp``)."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qkv_bias=True, router=moe_router(arch), shared_expert=True)


#: Q/K/V biases always (``qkv_bias``), the shared expert; llama.cpp's ``qwen2moe`` never renormalizes, and writes the
#: shared expert as ``ffn_*_shexp`` with its sigmoid gate ``ffn_gate_inp_shexp`` (a ``[hidden]`` row).
FAMILY = Family(Qwen2MoeModel, {"Qwen2MoeForCausalLM": {**QWEN_MOE_FIELDS, "shared_expert_intermediate_size": None,
                                                        "qkv_bias": (True,)}},
                gguf_architectures={"qwen2moe": "Qwen2MoeForCausalLM"},
                gguf_layer_names={"qwen2moe": {**GGUF_MOE_NAMES, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                                               "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                                               "ffn_up_shexp": "mlp.shared_expert.up_proj",
                                               "ffn_down_shexp": "mlp.shared_expert.down_proj"}},
                experts=Experts(renormalize=None, gguf={"qwen2moe": False}, shared_expert=True))
