"""OLMoE family (OlmoeForCausalLM: OLMoE-1B-7B; Muennighoff et al. 2024, "OLMoE: Open mixture-of-experts language
models", section 2): Llama's pre-norm decoder with the queries and keys RMS-normed over the whole projection (as
OLMo 2: ``qk_norm = "proj"``) and every MLP a mixture of 64 experts, 8 per token: softmax router, top-k, no
renormalization unless ``norm_topk_prob``."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, MOE_FIELDS, Experts, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router
from kvserve.model.qwen3 import QK_NORM_NAMES


class OlmoeModel(DecoderModel):
    """``DecoderModel`` reading ``self_attn.{q,k}_norm.weight`` (``[H_q D]``, ``[H_kv D]``), ``mlp.gate.weight``
    and ``mlp.experts.<e>.{gate,up,down}_proj.weight`` per layer (GGUF: ``attn_{q,k}_norm``, ``ffn_gate_inp``,
    ``ffn_*_exps``)."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qk_norm="proj", router=moe_router(arch))


#: ``clip_qkv`` is refused; llama.cpp's ``olmoe`` never renormalizes (its Q/K norms: ``attn_{q,k}_norm``).
FAMILY = Family(OlmoeModel, {"OlmoeForCausalLM": {**MOE_FIELDS, "hidden_act": ("silu",),
                                                  "attention_bias": (False, True), "norm_topk_prob": (False, True),
                                                  "clip_qkv": (None,)}},
                gguf_architectures={"olmoe": "OlmoeForCausalLM"},
                gguf_layer_names={"olmoe": {**QK_NORM_NAMES, **GGUF_MOE_NAMES}},
                experts=Experts(renormalize=None, gguf={"olmoe": False}))
