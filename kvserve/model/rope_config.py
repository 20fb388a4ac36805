"""A Hugging Face config's RoPE: its base and scaling scheme (``kvserve.layers.rotary.RopeScaling``), read from
either layout: the Hub's ``rope_scaling`` and transformers 5's ``rope_parameters``. Used by the config reader
(``hf_config``) and by the families that read their RoPE themselves (Gemma 3's per-layer tables)."""

from __future__ import annotations

from typing import Optional

from kvserve.layers.rotary import ROPE_TYPES, RopeScaling

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


def parse_rope(cfg: dict, where: str, partial_rotary: bool = False,
               aliases: Optional[dict] = None) -> tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, RopeScaling or None)`` of a Hugging Face config: ``rope_theta`` at the top level or inside
    ``rope_parameters`` (default 10000); the scheme from ``rope_scaling`` or ``rope_parameters`` (its type read
    through ``aliases``, a family's older names: ``family.Family.rope_type_aliases``); with ``partial_rotary`` (a
    family declaring ``partial_rotary_factor``: its model reorders the Q/K rows, ``partial_rotary_rows``) the
    ``partial_rotary_factor`` (inside the scheme or at the top level).

    Raises:
        ValueError: a scheme other than default / linear / dynamic / llama3 / yarn / longrope, a key the scheme
            does not take or a required one missing, per-layer-type parameters, or a partial rotary factor without
            ``partial_rotary``; the message names the field, the value and ``where`` (the file).
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
    rope_type = (aliases or {}).get(rope_type, rope_type)
    spec = {k: v for k, v in spec.items() if k not in ("rope_theta", "type", "rope_type")}
    partial = float(spec.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if partial != 1.0 and not partial_rotary:
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
