"""Gemma 2 and Gemma 3 text families (Gemma2ForCausalLM, Gemma3ForCausalLM; llama.cpp's ``gemma2`` / ``gemma3``).

The Llama decoder with (Gemma Team, "Gemma 2", 2024, section 2; "Gemma 3 Technical Report", 2025, section 2):
- RMSNorm scaled by ``(1 + w)`` (the checkpoint stores ``w``; computed in float32 as ``transformers`` does), and four
  norms per layer: before attention, on the attention output before its residual add, before the MLP, and on the
  MLP output before its residual add;
- embeddings multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype (as ``transformers`` does);
- a GeGLU MLP (``hidden_activation``, tanh-approximated GELU);
- softmax scale ``query_pre_attn_scalar ** -0.5`` (``ModelArch.attention_multiplier``);
- sliding-window attention on the ``"sliding_attention"`` layers (Gemma 2: every other layer; Gemma 3: five of
  six) and attention-logit soft-capping ``c * tanh(s / c)`` (Gemma 2): passed to the attention backend per layer;
- final-logit soft-capping ``c * tanh(logits / c)`` (``GemmaArch.final_logit_softcapping``);
- Gemma 3: per-head Q/K RMSNorm (``(1 + w)`` too) and per-layer RoPE: the sliding layers rotate with their own
  base (``rope_local_base_freq``, plain RoPE), the global layers with ``rope_theta`` and the RoPE scaling.

Sliding windows and attention soft-capping run in every attention backend (keyword arguments ``sliding_window`` /
``logit_softcap`` of ``AttentionBackend.forward_qkv``; docs/models.md, "Sliding-window attention").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvserve.layers.rotary import RopeScaling
from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.layer_spec import DecoderSpec, RopeSpec, llama_spec

#: Hugging Face architectures of this module -> llama.cpp's ``general.architecture``.
GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


@dataclass(frozen=True)
class GemmaArch(ModelArch):
    """``ModelArch`` plus what only the Gemma families use.

    Attributes:
        final_logit_softcapping: logits become ``c * tanh(logits / c)``; ``None``: no capping.
        local_rope_theta: the RoPE base of the ``"sliding_attention"`` layers (Gemma 3's ``rope_local_base_freq``);
            ``None``: every layer uses ``rope_theta`` and ``rope_scaling``.
        local_rope_scaling: the RoPE scaling of those layers (``None``: plain RoPE), when ``local_rope_theta`` is set.
    """

    final_logit_softcapping: Optional[float] = None
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[RopeScaling] = None


class GemmaModel(DecoderModel):
    """Gemma 2 / Gemma 3 (text) over the paged KV cache (implements ``CausalLM``); see the module docstring.

    Args:
        arch: a ``GemmaArch``.
        weights, backends: as ``DecoderModel``; the norm weights are Hugging Face's ``w`` (the model uses ``1 + w``),
            and each layer also has ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.

    Raises:
        ValueError: as ``DecoderModel``; a norm weight missing (named).
    """

    LAYER_NORMS = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
                   "mlp_norm": "pre_feedforward_layernorm.weight", "post_mlp_norm": "post_feedforward_layernorm.weight",
                   "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}

    @classmethod
    def spec(cls, arch: GemmaArch) -> DecoderSpec:
        ropes, local = (RopeSpec(arch.rope_theta, arch.rope_scaling),), arch.local_rope_theta is not None
        if local:
            ropes += (RopeSpec(arch.local_rope_theta, arch.local_rope_scaling),)
        kinds = arch.layer_types or tuple(
            "sliding_attention" if arch.sliding_window is not None else "full_attention"
            for _ in range(arch.num_hidden_layers))
        return llama_spec(arch, norms="both", ropes=ropes,
                          layer_ropes=tuple(int(local and k == "sliding_attention") for k in kinds),
                          norm_offset=1.0, embedding_multiplier=arch.hidden_size**0.5,
                          embedding_multiplier_in_dtype=True, final_logit_softcap=arch.final_logit_softcapping)
