"""Qwen2 family (Qwen2ForCausalLM): the Llama decoder with a bias on the Q, K and V projections
(Qwen2 technical report, Yang et al. 2024, §2.1), and the window of ``use_sliding_window`` on the layers it names."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family
from kvserve.model.layer_spec import DecoderSpec, llama_spec

#: Qwen2 / Qwen3's window: with ``use_sliding_window``, ``sliding_window`` on the layers ``layer_types`` names, by
#: default those from ``max_window_layers`` on (transformers' ``Qwen2Config``); without it, no window anywhere.
QWEN_WINDOW = {"use_sliding_window": (False, True), "sliding_window": None, "max_window_layers": None,
               "layer_types": None}


class Qwen2Model(DecoderModel):
    """``DecoderModel`` whose fused QKV projection requires ``self_attn.{q,k,v}_proj.bias``."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qkv_bias=True)


FAMILY = Family(Qwen2Model, {"Qwen2ForCausalLM": {**ANY_ACTIVATION, **QWEN_WINDOW}},
                gguf_architectures={"qwen2": "Qwen2ForCausalLM"})
