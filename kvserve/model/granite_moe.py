"""Granite-MoE family (GraniteMoeForCausalLM: Granite 3.0/3.1 1B-A400M and 3B-A800M; IBM 2024): Granite's decoder
(its four scalars) with every MLP a mixture of experts whose router takes the top-k logits, then a softmax over
them (``RouterSpec.scoring = "topk_softmax"``). Its checkpoints hold each layer's experts stacked:
``block_sparse_moe.input_linear.weight`` ``[E, 2I, H]`` (gate rows first), ``output_linear.weight`` ``[E, H, I]``,
``router.layer.weight`` ``[E, H]``; llama.cpp's ``granitemoe`` cuts them into ``ffn_{gate,up,down}_exps``.
A shared expert (GraniteMoeShared) is refused."""

from __future__ import annotations

from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.decoder import DecoderModel
from kvserve.model.family import GGUF_MOE_NAMES, MOE_FIELDS, Experts, Family
from kvserve.model.granite import GGUF_SCALARS, SCALAR_FIELDS, GraniteArch, multipliers, read_config, read_gguf
from kvserve.model.layer_spec import DecoderSpec, llama_spec, moe_router


def moe_weights(weights: dict) -> dict:
    """``weights`` with Granite-MoE's stacked tensors under the decoder's names (``mlp.gate``, the stacked
    ``mlp.experts.{gate,up,down}_proj``: views, no copy); others unchanged."""
    out = {}
    for name, w in weights.items():
        if ".block_sparse_moe." not in name:
            out[name] = w
            continue
        p = name.split("block_sparse_moe.")[0]
        if name.endswith("router.layer.weight"):
            out[p + "mlp.gate.weight"] = w
        elif name.endswith("input_linear.weight"):
            i = w.shape[1] // 2
            out[p + "mlp.experts.gate_proj.weight"], out[p + "mlp.experts.up_proj.weight"] = w[:, :i], w[:, i:]
        elif name.endswith("output_linear.weight"):
            out[p + "mlp.experts.down_proj.weight"] = w
        else:
            out[name] = w
    return out


class GraniteMoeModel(DecoderModel):
    """``DecoderModel`` over Granite-MoE's stacked experts (``moe_weights``)."""

    def __init__(self, arch: ModelArch, weights: dict, backends: ModelBackends):
        super().__init__(arch, moe_weights(weights), backends)

    @classmethod
    def spec(cls, arch) -> DecoderSpec:
        return llama_spec(arch, router=moe_router(arch, "topk_softmax"), **multipliers(arch))


#: Granite's scalars; the top-k-then-softmax weights need no renormalization (llama.cpp's ``granitemoe`` sets its
#: flag, a no-op after that softmax) and its Q/K rows are permuted as Llama's.
FAMILY = Family(GraniteMoeModel, {"GraniteMoeForCausalLM": {
    **MOE_FIELDS, "hidden_act": ("silu",), "attention_bias": (False, True), **SCALAR_FIELDS}},
    gguf_architectures={"granitemoe": "GraniteMoeForCausalLM"}, gguf_layer_names={"granitemoe": GGUF_MOE_NAMES},
    gguf_permuted_qk=("granitemoe",), experts=Experts(renormalize=False, gguf={"granitemoe": True}),
    arch_class=GraniteArch, read_config=read_config, read_gguf=read_gguf, gguf_keys={"granitemoe": tuple(GGUF_SCALARS)})
