"""Qwen2-MoE family (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Qwen2 technical report, Yang et al.
2024, section 2.2.2): Qwen2's decoder (Q/K/V biases) with a mixture-of-experts MLP -- a softmax router, top-k,
renormalized only when ``norm_topk_prob`` (llama.cpp's ``qwen2moe`` never) -- plus a shared expert every token runs,
scaled by ``sigmoid(shared_expert_gate(x))``, on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` make
sparse."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router


class Qwen2MoeModel(DecoderModel):
    """``DecoderModel`` reading ``mlp.gate``, ``mlp.experts.<e>.*``, ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate`` per sparse layer (GGUF: ``ffn_gate_inp``, ``ffn_*_exps``, ``ffn_*_shexp``,
    ``ffn_gate_inp_shexp``)."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qkv_bias=True, router=moe_router(arch), shared_expert=True)
