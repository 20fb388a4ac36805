"""SmolLM3 family (SmolLM3ForCausalLM): the Llama decoder in which some layers apply no RoPE ("NoPE", one layer in
four by default: Hugging Face's SmolLM3 release; Kazemnejad et al. 2023 on NoPE): ``LayerSpec.rope = None`` on
those layers (``layer_spec.llama_spec`` reads ``ModelArch.no_rope_layers``)."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel


class SmolLM3Model(DecoderModel):
    """``DecoderModel`` with SmolLM3's NoPE layers."""
