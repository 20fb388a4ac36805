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
from kvserve.model.family import Family, TextPart
from kvserve.model.layer_spec import ACTIVATIONS, DecoderSpec, RopeSpec, llama_spec
from kvserve.model.qwen3 import QK_NORM_NAMES
from kvserve.model.rope_config import parse_rope


@dataclass(frozen=True)
class GemmaArch(ModelArch):
    """``ModelArch`` plus what only the Gemma families use.

    Attributes:
        attn_logit_softcapping: attention scores become ``c * tanh(s / c)`` before the softmax (Gemma 2);
            ``None``: no capping.
        final_logit_softcapping: logits become ``c * tanh(logits / c)``; ``None``: no capping.
        local_rope_theta: the RoPE base of the ``"sliding_attention"`` layers (Gemma 3's ``rope_local_base_freq``);
            ``None``: every layer uses ``rope_theta`` and ``rope_scaling``.
        local_rope_scaling: the RoPE scaling of those layers (``None``: plain RoPE), when ``local_rope_theta`` is set.
    """

    attn_logit_softcapping: Optional[float] = None
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
        qk_norm = "head" if arch.architecture == "Gemma3ForCausalLM" else "none"
        return llama_spec(arch, norms="both", qk_norm=qk_norm, attn_softcap=arch.attn_logit_softcapping, ropes=ropes,
                          layer_ropes=tuple(int(local and k == "sliding_attention") for k in kinds),
                          norm_offset=1.0, embedding_multiplier=arch.hidden_size**0.5,
                          embedding_multiplier_in_dtype=True, final_logit_softcap=arch.final_logit_softcapping)


#: ``transformers``' defaults of the Gemma fields a config.json may leave out (they differ from Llama's).
_CONFIG_DEFAULTS = {
    "Gemma2ForCausalLM": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              tie_word_embeddings=True, max_position_embeddings=8192),
    "Gemma3ForCausalLM": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=None, final_logit_softcapping=None,
                              tie_word_embeddings=True, max_position_embeddings=131072),
}
#: The multimodal Gemma 3 whose text model kvserve runs (text prompts only: the same math as the text model):
#: ``transformers``' defaults of the fields a Hub ``text_config`` leaves out, and its text model's weight prefixes.
#: Its text class applies ``final_logit_softcapping``, the multimodal one not: a checkpoint setting it is refused.
_TEXT_PARTS = {"Gemma3ForConditionalGeneration": TextPart(
    "Gemma3ForCausalLM",
    dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
         num_key_value_heads=4, rms_norm_eps=1e-6),
    {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."},
    ignored={"final_logit_softcapping": (None,)})}


def read_config(cfg: dict, architecture: str, where: str) -> dict:
    """The ``GemmaArch`` fields of a Gemma config (``_CONFIG_DEFAULTS`` applied) beyond the common ones:
    ``hidden_activation``, the softmax scale ``query_pre_attn_scalar ** -0.5``, Gemma 3's per-layer RoPE
    (``_config_rope``), the windows and soft-caps (``_config_windows``).

    Raises:
        ValueError: as ``rope_config.parse_rope``, for either of Gemma 3's layer kinds."""
    fields = dict(hidden_act=cfg["hidden_activation"], attention_multiplier=float(cfg["query_pre_attn_scalar"]) ** -0.5)
    if architecture == "Gemma3ForCausalLM":
        theta, scaling, local = _config_rope(cfg, where)
        fields.update(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local[0], local_rope_scaling=local[1])
    return {**fields, **_config_windows(cfg, architecture)}


def _config_rope(cfg: dict, where: str) -> tuple[float, Optional[RopeScaling], tuple]:
    """Gemma 3's per-layer RoPE: ``(global theta, global scaling, (local theta, local scaling))``, from the Hub's
    ``rope_theta`` (default 1e6) + ``rope_scaling`` (global layers only) + ``rope_local_base_freq`` (default 1e4),
    or transformers 5's ``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``.

    Raises:
        ValueError: as ``parse_rope``, for either layer kind.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and set(params) & {"full_attention", "sliding_attention"}:
        if set(params) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"unsupported rope_parameters keys {sorted(params)} in {where}; supported: "
                             f"'full_attention', 'sliding_attention'")
        kinds = {}
        for kind, default in (("full_attention", 1e6), ("sliding_attention", 1e4)):
            spec = dict(params.get(kind) or {})
            spec.setdefault("rope_theta", default)
            sub = {"rope_parameters": spec, "max_position_embeddings": cfg.get("max_position_embeddings")}
            kinds[kind] = parse_rope(sub, f"{where} (rope_parameters.{kind})")
        return (*kinds["full_attention"], kinds["sliding_attention"])
    given = cfg.get("rope_theta") or (params or {}).get("rope_theta")
    theta, scaling = parse_rope(cfg if given else {**cfg, "rope_theta": 1e6}, where)
    return theta, scaling, (float(cfg.get("rope_local_base_freq", 1e4)), None)


def _config_windows(cfg: dict, architecture: str) -> dict:
    """The soft-caps and per-layer window kinds of a Gemma config (defaults applied; transformers' pattern when
    ``layer_types`` is absent: Gemma 2 every other layer, Gemma 3 ``sliding_window_pattern`` (6): five of six)."""
    n = cfg["num_hidden_layers"]
    pattern = 2 if architecture == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(n)]
    return dict(sliding_window=cfg["sliding_window"], layer_types=tuple(types),
                attn_logit_softcapping=cfg["attn_logit_softcapping"],
                final_logit_softcapping=cfg["final_logit_softcapping"])


#: Per Gemma GGUF architecture, as llama.cpp reads it: the metadata keys read instead of refused, with the values an
#: absent key means (Gemma 2's paper values), the window pattern (every ``n``-th layer global) and the layer count
#: of the 27B model (whose softmax scale is ``(hidden / heads) ** -0.5``, not ``head_dim ** -0.5``).
_GGUF = {"gemma2": ({"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}, 2, 46),
         "gemma3": ({"attention.sliding_window": None, "final_logit_softcapping": None}, 6, 62)}


def read_gguf(field, a: str, common: dict) -> dict:
    """The ``GemmaArch`` fields of a ``gemma2`` / ``gemma3`` GGUF beyond the common ones, as llama.cpp reads them:
    the window (``attention.sliding_window``) on all but every ``n``-th layer (llama.cpp's fixed pattern: it reads
    no pattern key for these), the soft-caps (absent keys: ``_GGUF``'s values), the softmax scale (``head_dim``, or
    ``hidden / heads`` for the 27B models), and Gemma 3's local RoPE base (``rope.freq_base_swa``, default 1e4;
    the file's RoPE scaling applies to the global layers only)."""
    keys, every, layers_27b = _GGUF[a]
    value = {k: field(f"{a}.{k}", default) for k, default in keys.items()}
    n = common["num_hidden_layers"]
    window = int(value["attention.sliding_window"]) if value["attention.sliding_window"] else None
    sliding = [window is not None and bool((i + 1) % every) for i in range(n)]
    scalar = common["hidden_size"] // common["num_attention_heads"] if n == layers_27b else common["head_dim"]
    fields = dict(hidden_act="gelu_pytorch_tanh", attention_multiplier=float(scalar) ** -0.5, sliding_window=window,
                  layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                  attn_logit_softcapping=value.get("attn_logit_softcapping") or None,  # 0: none
                  final_logit_softcapping=value["final_logit_softcapping"] or None)
    if a == "gemma3" and window is not None:
        fields["local_rope_theta"] = float(field(f"{a}.rope.freq_base_swa", 10000.0))
    return fields


#: Gemma 2 / 3 (text): their config fields (read by ``read_config``); Gemma 3 does not soft-cap attention
#: logits. llama.cpp's four norms per layer (its ``ffn_norm`` is Gemma's pre-feed-forward norm).
_GEMMA_FIELDS = {"hidden_activation": ACTIVATIONS, "attention_bias": (False, True), "sliding_window": None,
                 "layer_types": None, "sliding_window_pattern": None, "query_pre_attn_scalar": None,
                 "final_logit_softcapping": None, "use_bidirectional_attention": (None, False)}
_GGUF_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
FAMILY = Family(GemmaModel, {
    "Gemma2ForCausalLM": {**_GEMMA_FIELDS, "attn_logit_softcapping": None},
    "Gemma3ForCausalLM": {**_GEMMA_FIELDS, "attn_logit_softcapping": (None,), "rope_local_base_freq": None}},
    gguf_architectures={"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"},
    gguf_layer_names={"gemma2": _GGUF_NORMS, "gemma3": {**_GGUF_NORMS, **QK_NORM_NAMES}},
    arch_class=GemmaArch, config_defaults=_CONFIG_DEFAULTS, read_config=read_config, text_parts=_TEXT_PARTS,
    read_gguf=read_gguf, gguf_keys={g: tuple(keys) for g, (keys, _, _) in _GGUF.items()},
    gguf_norms_plus_one=tuple(_GGUF))
