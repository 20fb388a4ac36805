"""A Hugging Face ``config.json`` read into a ``ModelArch``, refusing what kvserve does not implement.

A serving engine must never silently change a model's math. So every family declares the config fields that
change it (``FAMILY_FIELDS``: the fields it implements, with the values it takes), and every field some family
uses that this one does not implement is checked against its "off" value (``OFF_VALUES``): a checkpoint that sets
one (a Mistral-style ``sliding_window`` on a Llama, Gemma's soft-capping, Granite's multipliers, Phi-3's partial
rotary, ...) is refused with a ``ValueError`` naming the field and its value. RoPE scaling is read from either
layout: the Hub's ``rope_scaling`` and transformers 5's ``rope_parameters`` (``rope_config.parse_rope``). What only
one family reads (its windows, scalars, NoPE layers, per-layer RoPE, defaults, ``ModelArch`` subclass) its own
module reads through the hooks of its ``family.Family``: no family's architecture is named here.
"""

from __future__ import annotations

from typing import Optional

from kvserve.model.base import ModelArch
from kvserve.model.registry import FAMILY_FIELDS, FAMILY_OF, TEXT_PARTS
from kvserve.model.rope_config import parse_rope

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

def check_not_moe(architectures, where: str) -> None:
    """Raise ``ValueError`` naming the architecture when ``architectures`` (a config's list) holds a
    mixture-of-experts model (``MOE_ARCHITECTURES``)."""
    moe = [a for a in architectures or () if a in MOE_ARCHITECTURES]
    if moe:
        raise ValueError(f"unsupported architecture {moe[0]!r} in {where}: this mixture-of-experts model is not "
                         f"supported (supported MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, "
                         f"gpt-oss)")


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
    """The ``ModelArch`` (the family's ``arch_class``) of a Hugging Face config: the family's ``config_defaults``
    under the file's values, ``check_fields``, the common fields (sizes, Llama's biases, ``hidden_act``, the RoPE:
    ``rope_config.parse_rope``, the experts: ``_moe``) and, over them, those the family reads itself
    (``Family.read_config``: windows, its own fields; ``family.Family``).

    Raises:
        ValueError: a field or value kvserve does not implement (named), or a missing size field.
    """
    family = FAMILY_OF[architecture]
    cfg = {**family.config_defaults.get(architecture, {}), **cfg}
    check_fields(cfg, architecture, where)
    fields = FAMILY_FIELDS[architecture]
    own = family.read_config(cfg, architecture, where) if family.read_config is not None else {}
    if "rope_theta" not in own:
        own["rope_theta"], own["rope_scaling"] = parse_rope(cfg, where, "partial_rotary_factor" in fields,
                                                            family.rope_type_aliases)
    n_head = cfg["num_attention_heads"]
    llama_biases = "attention_bias" in fields  # Llama's attention_bias (Q/K/V and o_proj) and mlp_bias
    llama_bias = llama_biases and bool(cfg.get("attention_bias", False))
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_head,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_head,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        architecture=architecture,
        attention_bias="qkv_bias" in fields or llama_bias,  # (the "qkv_bias" of Qwen2's fields: Q/K/V always)
        o_proj_bias=llama_bias,
        mlp_bias=llama_biases and bool(cfg.get("mlp_bias", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        moe=_moe(cfg, architecture, where),
    )
    return family.arch_class(**{**common, **own})


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


def text_part(cfg: dict) -> tuple[dict, Optional[dict]]:
    """``(config, renames)``: for a multimodal config of ``registry.TEXT_PARTS`` (``family.TextPart``), its text
    model's config (``text_config`` over ``transformers``' defaults, the top level's ``eos_token_id`` and
    ``tie_word_embeddings`` kept) and the weight-name prefixes to rename (tensors under none of them are left out);
    else ``(cfg, None)``.

    Raises:
        ValueError: a ``text_config`` field the multimodal class ignores at another value than it allows
            (``TextPart.ignored``: ambiguous, see the message).
    """
    archs = cfg.get("architectures") or ()
    part = next((TEXT_PARTS[a] for a in archs if a in TEXT_PARTS), None)
    if part is None:
        return cfg, None
    text = {**part.defaults, **(cfg.get("text_config") or {}), "architectures": [part.architecture]}
    for key, allowed in part.ignored.items():  # (Gemma 3's text class soft-caps the logits, its multimodal one not)
        if text.get(key) not in allowed:
            raise ValueError(f"unsupported text_config.{key}={text[key]!r} for {archs[0]} (transformers' multimodal "
                             f"class ignores it); supported: {', '.join(map(repr, allowed))}")
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key in cfg:
            text[key] = cfg[key]
    return text, part.renames
