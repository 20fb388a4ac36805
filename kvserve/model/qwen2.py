"""Qwen2 family (Qwen2ForCausalLM): the Llama decoder with a bias on the Q, K and V projections
(Qwen2 technical report, Yang et al. 2024, §2.1), and the window of ``use_sliding_window`` on the layers it names."""

from __future__ import annotations

from kvserve.model.decoder import DecoderModel
from kvserve.model.family import ANY_ACTIVATION, Family, layer_types_window
from kvserve.model.layer_spec import DecoderSpec, llama_spec

#: Qwen2 / Qwen3's window: with ``use_sliding_window``, ``sliding_window`` on the layers ``layer_types`` names, by
#: default those from ``max_window_layers`` on (transformers' ``Qwen2Config``); without it, no window anywhere.
QWEN_WINDOW = {"use_sliding_window": (False, True), "sliding_window": None, "max_window_layers": None,
               "layer_types": None}


def qwen_window(cfg: dict) -> dict:
    """``ModelArch``'s ``sliding_window`` and ``layer_types`` of a Qwen2 / Qwen3 config, as transformers reads them:
    only with ``use_sliding_window``, on the layers of ``layer_types``, by default those with index
    ``>= max_window_layers`` (default 28); none when no layer is windowed."""
    window = cfg.get("sliding_window")
    if not (cfg.get("use_sliding_window") and window):
        return {}
    n, first = cfg["num_hidden_layers"], cfg.get("max_window_layers", 28)
    return layer_types_window(window, cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)])


class Qwen2Model(DecoderModel):
    """``DecoderModel`` whose fused QKV projection requires ``self_attn.{q,k,v}_proj.bias``."""

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, qkv_bias=True)


#: Q/K/V biases always (``qkv_bias``: no config field says so); the window of ``qwen_window``.
FAMILY = Family(Qwen2Model, {"Qwen2ForCausalLM": {**ANY_ACTIVATION, **QWEN_WINDOW, "qkv_bias": (True,)}},
                gguf_architectures={"qwen2": "Qwen2ForCausalLM"},
                read_config=lambda cfg, architecture, where: qwen_window(cfg))
