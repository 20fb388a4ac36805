"""OLMo 2 family (Olmo2ForCausalLM; OLMo et al. 2024, "2 OLMo 2 Furious", section 3.2): the Llama decoder with
the norms moved after the sub-layers -- each layer is ``h + norm(attn(h))`` then ``h + norm(mlp(h))``, no norm
before either (``LayerSpec.norms = "post"``) -- and the queries and keys RMS-normed over the whole projection
(``[H_q D]`` and ``[H_kv D]`` weights, not one per head as Qwen3: ``qk_norm = "proj"``) before RoPE; tensor
parallelism is refused (the Q/K norm spans every head)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.layer_spec import DecoderSpec, llama_spec


class Olmo2Model(DecoderModel):
    """``DecoderModel`` reading, per layer, ``post_attention_layernorm``, ``post_feedforward_layernorm`` and
    ``self_attn.{q,k}_norm`` (``[H_q D]``, ``[H_kv D]``) and no ``input_layernorm``."""

    LAYER_NORMS = {"post_attn_norm": "post_attention_layernorm.weight",
                   "post_mlp_norm": "post_feedforward_layernorm.weight",
                   "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, norms="post", qk_norm="proj")
