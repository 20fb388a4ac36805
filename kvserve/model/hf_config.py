"""A Hugging Face ``config.json`` read into a ``ModelArch``, refusing what kvserve does not implement.

A serving engine must never silently change a model's math. So every family declares the config fields that
change it (``FAMILY_FIELDS``: the fields it implements, with the values it takes), and every field some family
uses that this one does not implement is checked against its "off" value (``OFF_VALUES``): a checkpoint that sets
one (a Mistral-style ``sliding_window`` on a Llama, Gemma's soft-capping, Granite's multipliers, Phi-3's partial
rotary, ...) is refused with a ``ValueError`` naming the field and its value. RoPE scaling is read from either
layout: the Hub's ``rope_scaling`` and transformers 5's ``rope_parameters`` (``parse_rope``).
"""

from __future__ import annotations

from typing import Optional

from kvserve.layers.rotary import ROPE_TYPES, RopeScaling
from kvserve.model.base import ModelArch
from kvserve.model.registry import FAMILY_FIELDS, FAMILY_OF

#: Mixture-of-experts architectures (Hugging Face names) kvserve does not run, refused as such (``check_not_moe``):
#: DeepSeek's multi-head latent attention, hybrid linear-attention / state-space models (Jamba, Qwen3-Next,
#: Granite-MoE-Hybrid), DBRX's clipped fused QKV and its own expert layout, Llama 4's interleaved chunked attention,
#: PhiMoE's sparsemixer router, Granite-MoE with a shared expert, and the rest. The MoE families kvserve runs are
#: registry families (``family.Experts``).
MOE_ARCHITECTURES = ("PhimoeForCausalLM", "PhiMoEForCausalLM", "GraniteMoeSharedForCausalLM",
                     "GraniteMoeHybridForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                     "DbrxForCausalLM", "JambaForCausalLM", "Llama4ForCausalLM",
                     "Llama4ForConditionalGeneration", "Ernie4_5_MoeForCausalLM", "HunYuanMoEV1ForCausalLM",
                     "Qwen3NextForCausalLM")
#: ``transformers``' defaults for the Gemma fields a config.json may leave out (they differ from Llama's).
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              tie_word_embeddings=True, max_position_embeddings=8192),
    "Gemma3ForCausalLM": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=None, final_logit_softcapping=None,
                              tie_word_embeddings=True, max_position_embeddings=131072),
}
#: Multimodal architectures whose text model kvserve runs (text prompts only: the same math as the text model) ->
#: (the text model's architecture, ``transformers``' defaults of the fields a Hub ``text_config`` leaves out,
#: weight-name prefixes of the text model -> the text model's names; the vision tower and projector are not read).
TEXT_PARTS = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
             num_key_value_heads=4, rms_norm_eps=1e-6),
        {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}),
}

#: Fields of other families (or of features not built yet) that change the math, and the values that mean "off";
#: any other value is refused.
OFF_VALUES = {
    "sliding_window": (None,),  # Mistral, Gemma, Qwen2 (there only with use_sliding_window)
    "layer_types": (None,),  # per-layer attention kinds (checked: all "full_attention" passes)
    "partial_rotary_factor": (None, 1.0),  # Phi-3, StableLM (1 == 1.0 passes too)
    "attn_logit_softcapping": (None,),  # Gemma 2
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1.0),  # Granite
    "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,),
    "logits_scaling": (None, 1.0),
    "no_rope_layers": (None,),  # SmolLM3
    "num_experts": (None, 0),  # mixture of experts
    "num_local_experts": (None, 0),
    "n_routed_experts": (None, 0),
    "use_qk_norm": (None, False),
}

#: The keys a ``rope_scaling`` / ``rope_parameters`` entry of each type may hold (others are refused).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
    "dynamic": {"factor"},
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"},
}
_ROPE_REQUIRED = {"linear": {"factor"}, "llama3": _ROPE_KEYS["llama3"], "yarn": {"factor"}, "dynamic": {"factor"},
                  "longrope": {"short_factor", "long_factor"}}
#: Families that implement ``partial_rotary_factor`` (their model reorders the Q/K rows: ``partial_rotary_rows``).
_PARTIAL_ROTARY = ("Phi3ForCausalLM",)
#: Older Phi-3 configs' names of LongRoPE, read as transformers' ``Phi3Config`` reads them.
_PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}


def check_not_moe(architectures, where: str) -> None:
    """Raise ``ValueError`` naming the architecture when ``architectures`` (a config's list) holds a
    mixture-of-experts model (``MOE_ARCHITECTURES``)."""
    moe = [a for a in architectures or () if a in MOE_ARCHITECTURES]
    if moe:
        raise ValueError(f"unsupported architecture {moe[0]!r} in {where}: this mixture-of-experts model is not "
                         f"supported (supported MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, "
                         f"gpt-oss)")


def parse_rope(cfg: dict, where: str, architecture: str = "") -> tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, RopeScaling or None)`` of a config: ``rope_theta`` at the top level or inside
    ``rope_parameters`` (default 10000); the scheme from ``rope_scaling`` or ``rope_parameters``; for the families
    in ``_PARTIAL_ROTARY`` the ``partial_rotary_factor`` (inside the scheme or at the top level).

    Raises:
        ValueError: a scheme other than default / linear / dynamic / llama3 / yarn / longrope, a key the scheme
            does not take or a required one missing, per-layer-type parameters, or a partial rotary factor outside
            ``_PARTIAL_ROTARY``; the message names the field, the value and ``where`` (the file).
    """
    params = cfg.get("rope_parameters")
    field, spec = ("rope_scaling", cfg["rope_scaling"]) if cfg.get("rope_scaling") else ("rope_parameters", params)
    theta = cfg.get("rope_theta") or (params or {}).get("rope_theta") or 10000.0
    if not spec:
        return float(theta), None
    if not isinstance(spec, dict) or any(isinstance(v, dict) for v in spec.values()):
        raise ValueError(f"unsupported {field} {spec!r} in {where}: one scheme for every layer is supported")
    type_key = "rope_type" if "rope_type" in spec else "type"  # the Hub's older configs say "type"
    rope_type = spec.get(type_key, "default")
    if architecture == "Phi3ForCausalLM":
        rope_type = _PHI3_ROPE_ALIASES.get(rope_type, rope_type)
    spec = {k: v for k, v in spec.items() if k not in ("rope_theta", "type", "rope_type")}
    partial = float(spec.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if partial != 1.0 and architecture not in _PARTIAL_ROTARY:
        raise ValueError(f"unsupported {field}.partial_rotary_factor={partial!r} in {where}; supported: 1.0")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"unsupported {field}.{type_key}={rope_type!r} in {where}; supported: "
                         f"{('default',) + ROPE_TYPES}")
    extra = sorted(set(spec) - _ROPE_KEYS[rope_type])
    if extra:
        raise ValueError(f"unsupported {field} key(s) {extra} for rope_type {rope_type!r} in {where}; supported: "
                         f"{sorted(_ROPE_KEYS[rope_type])}")
    missing = sorted(_ROPE_REQUIRED.get(rope_type, set()) - set(spec))
    if missing:
        raise ValueError(f"{field} of rope_type {rope_type!r} in {where} lacks {missing}")
    if rope_type == "default":
        return float(theta), RopeScaling(partial_rotary_factor=partial) if partial != 1.0 else None
    if rope_type == "yarn" and not spec.get("original_max_position_embeddings"):
        spec["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
    if rope_type == "longrope":
        spec["original_max_position_embeddings"] = (spec.get("original_max_position_embeddings")
                                                    or cfg.get("original_max_position_embeddings"))
        if not spec["original_max_position_embeddings"]:
            raise ValueError(f"{field} of rope_type 'longrope' in {where} lacks original_max_position_embeddings")
        if not spec.get("factor"):  # transformers: the ratio of the two contexts
            spec["factor"] = cfg.get("max_position_embeddings", 2048) / spec["original_max_position_embeddings"]
        spec["short_factor"], spec["long_factor"] = tuple(spec["short_factor"]), tuple(spec["long_factor"])
    if rope_type in ("dynamic", "longrope"):
        spec["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    return float(theta), RopeScaling(rope_type=rope_type, partial_rotary_factor=partial, **spec)


def check_fields(cfg: dict, architecture: str, where: str) -> None:
    """Refuse every math-changing field ``architecture`` does not implement with a value other than "off", and
    every implemented field with a value it does not take (``FAMILY_FIELDS``, ``OFF_VALUES``).

    Raises:
        ValueError: naming the field, its value, the supported values and ``where``.
    """
    fields = FAMILY_FIELDS[architecture]
    for name, allowed in fields.items():
        if name in cfg and allowed is not None and cfg[name] not in allowed:
            raise ValueError(f"unsupported {name}={cfg[name]!r} for {architecture} in {where}; supported: {allowed}")
    for name, off in OFF_VALUES.items():
        if name in fields or name not in cfg or cfg[name] in off:
            continue
        if name == "layer_types" and all(t == "full_attention" for t in cfg[name]):
            continue
        if name == "sliding_window" and "use_sliding_window" in fields and not cfg.get("use_sliding_window"):
            continue  # Qwen2/3 configs carry a window that is off unless use_sliding_window
        raise ValueError(f"unsupported {name}={cfg[name]!r} for {architecture} in {where}: kvserve does not "
                         f"implement it; supported: {off}")


def arch_from_config(cfg: dict, architecture: str, where: str) -> ModelArch:
    """The ``ModelArch`` of a Hugging Face config (``check_fields`` and ``parse_rope`` first).

    Raises:
        ValueError: a field or value kvserve does not implement (named), or a missing size field.
    """
    if architecture in _GEMMA_DEFAULTS:
        cfg = {**_GEMMA_DEFAULTS[architecture], **cfg}
    check_fields(cfg, architecture, where)
    if architecture == "Gemma3ForCausalLM":
        theta, scaling, local = _gemma3_rope(cfg, where)
    else:
        theta, scaling = parse_rope(cfg, where, architecture)
    n_head = cfg["num_attention_heads"]
    fields = FAMILY_FIELDS[architecture]
    llama_biases = "attention_bias" in fields  # Llama's attention_bias (Q/K/V and o_proj) and mlp_bias
    llama_bias = llama_biases and bool(cfg.get("attention_bias", False))
    granite = "embedding_multiplier" in fields  # Granite's four scalars (Granite, Granite-MoE)
    gemma = architecture in _GEMMA_DEFAULTS
    cls, extra = ModelArch, {}
    if gemma:
        from kvserve.model.gemma import GemmaArch

        cls = GemmaArch
        extra = _gemma_fields(cfg, architecture, local if architecture == "Gemma3ForCausalLM" else None)
    return cls(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_head,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_head,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        architecture=architecture,
        attention_bias=architecture == "Qwen2ForCausalLM" or "qkv_bias" in fields or llama_bias,
        o_proj_bias=llama_bias,
        mlp_bias=llama_biases and bool(cfg.get("mlp_bias", False)),
        hidden_act=cfg["hidden_activation"] if gemma else cfg.get("hidden_act", "silu"),
        rope_scaling=scaling,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite else 1.0,
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
        attention_multiplier=(float(cfg.get("attention_multiplier", 1.0)) if granite
                              else float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
        no_rope_layers=(tuple(int(x) for x in cfg["no_rope_layers"])
                        if architecture == "SmolLM3ForCausalLM" and cfg.get("no_rope_layers") else None),
        moe=_moe(cfg, architecture, where),
        **_window(cfg, architecture),
        **extra,
    )


def _moe(cfg: dict, architecture: str, where: str):
    """The ``MoEArch`` of a mixture-of-experts config (``None`` for the other families): the expert count
    (``num_experts`` or ``num_local_experts``), ``num_experts_per_tok``, the expert width (``moe_intermediate_size``,
    else ``intermediate_size``), the renormalization (the family's ``Experts.renormalize``, else ``norm_topk_prob``),
    Qwen2-MoE's shared expert, and which layers are sparse (Qwen's
    ``decoder_sparse_step`` and ``mlp_only_layers``, as transformers' ``Qwen2MoeDecoderLayer``).

    Raises:
        ValueError: no expert count, or ``num_experts_per_tok`` outside ``[1, experts]`` (naming the field)."""
    from kvserve.model.base import MoEArch

    rules = FAMILY_OF[architecture].experts
    if rules is None:
        return None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok", 2)
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{architecture} in {where} needs num_experts (or num_local_experts) >= 1, got {experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"unsupported num_experts_per_tok={top_k!r} for {architecture} in {where}; supported: "
                         f"1..{experts}")
    n, step = cfg["num_hidden_layers"], int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    swiglu = {k: float(cfg[k]) for k in ("swiglu_alpha", "swiglu_limit")
              if k in FAMILY_FIELDS[architecture] and cfg.get(k) is not None}
    return MoEArch(num_experts=experts, top_k=top_k, **swiglu,
                   intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                   renormalize=(rules.renormalize if rules.renormalize is not None
                                else bool(cfg.get("norm_topk_prob", False))),
                   shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                   if rules.shared_expert else 0,
                   sparse_layers=sparse)


def _window(cfg: dict, architecture: str) -> dict:
    """``ModelArch``'s ``sliding_window`` and ``layer_types`` as transformers reads them: Mistral windows every layer
    (transformers ignores a Mistral's ``layer_types``; ``check_fields`` refuses one that is not all full); Qwen2/3
    only with ``use_sliding_window``, on the layers of ``layer_types``, by default those with index
    ``>= max_window_layers`` (default 28); gpt-oss on the layers of ``layer_types`` (default: every other one from
    the first); other families: no window (``check_fields`` refused one; Gemma's windows are read by
    ``_gemma_fields``)."""
    window, fields = cfg.get("sliding_window"), FAMILY_FIELDS[architecture]
    if architecture == "Phi3ForCausalLM":  # every layer, as Mistral; a window covering the whole context is none
        covers = window is None or window >= cfg.get("max_position_embeddings", 2048)
        return {} if covers else {"sliding_window": window}
    if "sliding_window" in fields and not {"use_sliding_window", "layer_types"} & set(fields):
        return {"sliding_window": window}  # Mistral, Mixtral: every layer
    if {"sliding_window", "layer_types"} <= set(fields) and not (
            "use_sliding_window" in fields or architecture in _GEMMA_DEFAULTS):
        # gpt-oss: the layers of layer_types, by default every other one from the first (transformers' default)
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        if not window or "sliding_attention" not in types:
            return {}
        return {"sliding_window": int(window), "layer_types": tuple(types)}
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not (cfg.get("use_sliding_window") and window):
        return {}
    n, first = cfg["num_hidden_layers"], cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if "sliding_attention" not in types:  # (max_window_layers >= the layer count: no layer is windowed)
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def text_part(cfg: dict) -> tuple[dict, Optional[dict]]:
    """``(config, renames)``: for a multimodal config in ``TEXT_PARTS``, its text model's config (``text_config``
    over ``transformers``' defaults, the top level's ``eos_token_id`` and ``tie_word_embeddings`` kept) and the
    weight-name prefixes to rename (tensors under none of them are left out); else ``(cfg, None)``.

    Raises:
        ValueError: a Gemma 3 ``text_config`` with a final-logit soft-cap (ambiguous: see the message).
    """
    archs = cfg.get("architectures") or ()
    part = next((TEXT_PARTS[a] for a in archs if a in TEXT_PARTS), None)
    if part is None:
        return cfg, None
    architecture, defaults, renames = part
    text = {**defaults, **(cfg.get("text_config") or {}), "architectures": [architecture]}
    if text.get("final_logit_softcapping") is not None:  # Gemma 3's text class applies it, its multimodal one not
        raise ValueError(f"unsupported text_config.final_logit_softcapping={text['final_logit_softcapping']!r} for "
                         f"{archs[0]} (transformers' multimodal class ignores it); supported: None")
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key in cfg:
            text[key] = cfg[key]
    return text, renames


def _gemma3_rope(cfg: dict, where: str) -> tuple[float, Optional[RopeScaling], tuple]:
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


def _gemma_fields(cfg: dict, architecture: str, local: Optional[tuple]) -> dict:
    """The ``GemmaArch`` fields of a Gemma config (defaults applied): the soft-caps, per-layer
    window kinds (transformers' pattern when ``layer_types`` is absent: Gemma 2 every other layer, Gemma 3
    ``sliding_window_pattern`` (6): five of six) and Gemma 3's local RoPE."""
    n = cfg["num_hidden_layers"]
    pattern = 2 if architecture == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(n)]
    fields = dict(sliding_window=cfg["sliding_window"], layer_types=tuple(types),
                  attn_logit_softcapping=cfg["attn_logit_softcapping"],
                  final_logit_softcapping=cfg["final_logit_softcapping"])
    if local is not None:
        fields.update(local_rope_theta=local[0], local_rope_scaling=local[1])
    return fields
