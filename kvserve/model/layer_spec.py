"""A decoder layer described once: what each layer of a model computes, as data.

A family says what its layers do in a ``DecoderSpec`` (built from its ``ModelArch`` by the family's module); the
one Python layer loop (``kvserve.model.decoder``) interprets it, and the fused C loop (``kvserve.model.fused_layers``,
``csrc/decoder.c``) runs the same description or declines, naming the one op it lacks. Nothing else branches on
the family.

One layer, in the order both loops run it (``h``: the residual stream, ``x``: the layer's input)::

    x    = norm(h, attn_norm)                      norms "pre" / "both"; "post": x = h
    qkv  = x W_qkv (+ b_qkv); Q/K norm             qk_norm: "none" / "head" (per head, [D]) / "proj" ([H D])
    a    = attention(RoPE(qkv))                    rope table rope (None: NoPE), window, attn_softcap, sinks
    d    = a W_o (+ b_o) (* residual_multiplier)
    d    = norm(d, post_attn_norm)                 norms "post" / "both"
    h   += d;  x = norm(h, mlp_norm)               norms "pre" / "both"; "post": x = h
    d    = down(act(gate) * up) (+ biases) (* residual_multiplier)     mlp "dense"
    d    = moe(x) (* residual_multiplier)          mlp "moe": router + experts (``kvserve.layers.moe``)
    d    = norm(d, post_mlp_norm)                  norms "post" / "both"
    h   += d                                       (fused with the next layer's input norm where there is one)

Norms are RMSNorm (Zhang & Sennrich 2019); with ``norm_offset`` 1 the scale is ``1 + w`` in float32 (Gemma).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from kvserve.layers.moe import ACTIVATIONS as EXPERT_ACTIVATIONS, RouterSpec
from kvserve.layers.rotary import RopeScaling
from kvserve.model.base import HIDDEN_ACTS

#: ``LayerSpec.norms`` values: Llama's two pre-norms, OLMo 2's two post-norms, Gemma's four.
NORM_PLACEMENTS = ("pre", "post", "both")
#: ``LayerSpec.qk_norm`` values: none, per head over ``D`` (Qwen3, Gemma 3), over the whole ``[H D]`` projection
#: (OLMo 2).
QK_NORMS = ("none", "head", "proj")
#: ``LayerSpec.mlp`` values: a gated MLP, or a mixture of experts (``DecoderSpec.router``; ``kvserve.layers.moe``).
MLP_KINDS = ("dense", "moe")
#: ``DecoderSpec.activation`` values (Hugging Face's names): SiLU, exact GELU, tanh-approximated GELU.
ACTIVATIONS = HIDDEN_ACTS


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: the base and the scaling scheme (``kvserve.layers.rotary``; ``None``: plain RoPE)."""

    theta: float
    scaling: Optional[RopeScaling] = None


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer computes (module docstring).

    Attributes:
        norms: ``"pre"`` (``attn_norm``, ``mlp_norm``), ``"post"`` (``post_attn_norm``, ``post_mlp_norm``) or
            ``"both"`` (all four).
        qk_norm: one of ``QK_NORMS``.
        rope: index into ``DecoderSpec.ropes`` of this layer's RoPE table; ``None``: no rotation (NoPE).
        window: attention window in tokens (the query at ``p`` sees keys ``p - window < j <= p``); ``None``: none.
        attn_softcap: attention scores become ``c * tanh(s / c)`` before the softmax; ``None``: no capping.
        mlp: one of ``MLP_KINDS``.
    """

    norms: str = "pre"
    qk_norm: str = "none"
    rope: Optional[int] = 0
    window: Optional[int] = None
    attn_softcap: Optional[float] = None
    mlp: str = "dense"

    def __post_init__(self) -> None:
        for name, allowed in (("norms", NORM_PLACEMENTS), ("qk_norm", QK_NORMS), ("mlp", MLP_KINDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LayerSpec.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"LayerSpec.window must be a positive number of tokens or None, got {self.window}")
        if self.attn_softcap is not None and not self.attn_softcap > 0:
            raise ValueError(f"LayerSpec.attn_softcap must be positive or None, got {self.attn_softcap}")

    @property
    def pre_norms(self) -> bool:
        """Whether the layer norms its attention and MLP inputs (``attn_norm``, ``mlp_norm``)."""
        return self.norms != "post"

    @property
    def post_norms(self) -> bool:
        """Whether the layer norms its attention and MLP outputs (``post_attn_norm``, ``post_mlp_norm``)."""
        return self.norms != "pre"


@dataclass(frozen=True)
class DecoderSpec:
    """A whole decoder: the per-layer specs and the model-wide scalars.

    Attributes:
        layers: one ``LayerSpec`` per layer.
        ropes: the RoPE tables the layers index (Gemma 3: global and local).
        activation: the gated MLP's activation, one of ``ACTIVATIONS``.
        attention_scale: the softmax scale (``head_dim ** -0.5``; Granite's ``attention_multiplier``, Gemma's
            ``query_pre_attn_scalar ** -0.5``).
        residual_multiplier: each sub-layer's output is multiplied by it before the residual add (Granite).
        embedding_multiplier: the embeddings are multiplied by it (Granite; Gemma's ``sqrt(hidden)``).
        embedding_multiplier_in_dtype: the multiplier is first rounded to the model's dtype (as ``transformers``
            does Gemma's).
        logits_divisor: the logits are divided by it (Granite's ``logits_scaling``).
        final_logit_softcap: the logits become ``c * tanh(logits / c)`` (Gemma 2); ``None``: no capping.
        norm_offset: RMSNorm scales by ``norm_offset + w`` (Gemma: 1, computed in float32); 0: ``w``.
        qkv_bias, o_bias, mlp_bias: the Q/K/V, output and gate/up/down projections carry biases.
        router: the router of the ``"moe"`` layers (``kvserve.layers.moe.RouterSpec``); ``None`` when none is.
        shared_expert: the ``"moe"`` layers add a shared expert times ``sigmoid(shared_expert_gate(x))``
            (Qwen2-MoE).
        attention_sinks: every layer's attention has a learned sink logit per query head in its softmax
            denominator (gpt-oss: ``self_attn.sinks`` ``[H_q]``; ``AttentionBackend.forward``'s ``sinks``).
        expert_activation: the experts' activation, one of ``kvserve.layers.moe.ACTIVATIONS`` (gpt-oss:
            ``"swiglu_oai"`` with ``expert_alpha`` and ``expert_limit``).
        expert_bias: the router and the experts' projections carry biases (gpt-oss).
    """

    layers: tuple
    ropes: tuple
    activation: str = "silu"
    attention_scale: float = 1.0
    residual_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    embedding_multiplier_in_dtype: bool = False
    logits_divisor: float = 1.0
    final_logit_softcap: Optional[float] = None
    norm_offset: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    router: Optional[RouterSpec] = None
    shared_expert: bool = False
    attention_sinks: bool = False
    expert_activation: str = "silu"
    expert_alpha: float = 1.702
    expert_limit: float = 7.0
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"DecoderSpec.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"DecoderSpec.expert_activation must be one of {EXPERT_ACTIVATIONS}, got "
                             f"{self.expert_activation!r}")
        bad = [i for i, s in enumerate(self.layers) if s.rope is not None and not 0 <= s.rope < len(self.ropes)]
        if bad:
            raise ValueError(f"layers {bad} name a RoPE table outside the {len(self.ropes)} of the spec")
        moe = [i for i, s in enumerate(self.layers) if s.mlp == "moe"]
        if moe and self.router is None:
            raise ValueError(f"layers {moe[:4]} have a mixture-of-experts MLP but the spec has no router")

    def first(self, num_layers: int) -> "DecoderSpec":
        """The spec of the first ``num_layers`` layers (an early-exit draft)."""
        return dataclasses.replace(self, layers=self.layers[:num_layers])

    @property
    def norm_kinds(self) -> set:
        """The norm placements of the layers (a model mixes none today; the loops take any mix)."""
        return {s.norms for s in self.layers}


def llama_spec(arch, norms: str = "pre", qk_norm: str = "none", ropes: Optional[tuple] = None,
               layer_ropes: Optional[tuple] = None, attn_softcap: Optional[float] = None, **fields) -> DecoderSpec:
    """The spec of a Llama-like decoder from its ``ModelArch``: ``norms``, ``qk_norm`` and ``attn_softcap`` (the
    family's) on every layer, the windows of ``arch.layer_window``, each layer's RoPE table index (``layer_ropes``,
    ``None`` for a NoPE layer; default: table 0 everywhere), one RoPE table of ``arch.rope_theta`` and
    ``arch.rope_scaling`` unless ``ropes`` are given, the activation, softmax scale and biases of ``arch``, ``"moe"``
    MLPs on ``arch.moe.sparse_layers``; ``fields`` override ``DecoderSpec``'s (a mixture of experts needs
    ``router``: ``moe_router``; Granite its multipliers)."""
    n = arch.num_hidden_layers
    if layer_ropes is None:
        layer_ropes = (0,) * n
    sparse = arch.moe.sparse_layers if arch.moe is not None else (False,) * n
    layers = tuple(LayerSpec(norms=norms, qk_norm=qk_norm, rope=layer_ropes[i], window=arch.layer_window(i),
                             attn_softcap=attn_softcap, mlp="moe" if sparse[i] else "dense")
                   for i in range(n))
    base = dict(layers=layers, ropes=ropes or (RopeSpec(arch.rope_theta, arch.rope_scaling),),
                activation=arch.hidden_act, attention_scale=arch.attention_scale, qkv_bias=arch.attention_bias,
                o_bias=arch.o_proj_bias, mlp_bias=arch.mlp_bias)
    return DecoderSpec(**{**base, **fields})


def moe_router(arch, scoring: str = "softmax_topk") -> RouterSpec:
    """The ``RouterSpec`` of ``arch.moe`` with the family's ``scoring`` (``renormalize`` with ``"softmax_topk"``
    only: the ``"topk_softmax"`` weights already sum to 1)."""
    m = arch.moe
    return RouterSpec(m.num_experts, m.top_k, scoring, m.renormalize and scoring == "softmax_topk")
