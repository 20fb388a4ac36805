"""SmolLM3 family (SmolLM3ForCausalLM): the Llama decoder in which some layers apply no RoPE ("NoPE", one layer in
four by default: Hugging Face's SmolLM3 release; Kazemnejad et al. 2023 on NoPE). ``ModelArch.no_rope_layers`` carries
the per-layer choice; ``LlamaModel`` rotates those layers by the identity (the fused C loop does not take such
models, so they run the Python loop)."""

from __future__ import annotations

from kvserve.model.llama import LlamaModel


class SmolLM3Model(LlamaModel):
    """``LlamaModel`` with SmolLM3's NoPE layers (``ModelArch.no_rope_layers``)."""
