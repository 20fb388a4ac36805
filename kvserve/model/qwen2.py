"""Qwen2 family (Qwen2ForCausalLM): the Llama decoder with a bias on the Q, K and V projections
(Qwen2 technical report, Yang et al. 2024, §2.1), and the window of ``use_sliding_window`` on the layers it names."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.layer_spec import DecoderSpec, llama_spec


class Qwen2Model(DecoderModel):
    """``DecoderModel`` whose fused QKV projection requires ``self_attn.{q,k,v}_proj.bias``."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qkv_bias=True)
