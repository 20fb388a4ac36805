"""The one home of argument checks: each raises ``ValueError`` naming the field and the allowed range."""

from __future__ import annotations

import math
from typing import Optional


def check_int(name: str, value, low: int, high: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high]`` (``high=None``: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        rng = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


def check_number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite int or float (not a bool) in ``[low, high]``
    (``(low, high]`` with ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise ValueError(f"{name} must be in {lo}{low}, {high}], got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_text(name: str, value: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is valid Unicode text (encodable as UTF-8).

    JSON can carry a lone UTF-16 surrogate (``"\\ud800"``); it is no character, so no tokenizer, chat template or
    stop-string match can take it. Every client-controlled string that reaches those is checked here first.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: a lone surrogate {value[e.start]!a} at character "
                         f"{e.start} (it cannot be encoded as UTF-8)") from None
