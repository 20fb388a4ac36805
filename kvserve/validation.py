"""The one home of argument checks: each raises ``ParamError`` (a ``ValueError``) naming the field and the allowed
range; the HTTP layer reads the field from ``ParamError.field``, never from the message."""

from __future__ import annotations

import math
from typing import Optional


class ParamError(ValueError):
    """A bad value of one field: ``field`` names it (``max_tokens``, ``stop[1]``, ``structured_outputs.json``, a
    schema path ``structured_outputs.json.properties.x``), ``message`` is the whole text (``str(e)``).

    Built by ``ParamError.of(field, rest)`` the message is ``field + rest`` and ``renamed`` can name the field as
    a caller spells it (``max_completion_tokens`` for the engine's ``max_tokens``) without reading the text.
    """

    def __init__(self, field: str, message: str, rest: Optional[str] = None):
        super().__init__(message)
        self.field, self.message, self.rest = field, message, rest

    @classmethod
    def of(cls, field: str, rest: str) -> "ParamError":
        """The error ``field + rest`` (``rest`` starts with the text after the name: `` must be ...``)."""
        return cls(field, field + rest, rest)

    def renamed(self, field: str) -> "ParamError":
        """The same error naming ``field`` instead (the message too, when built by ``of``)."""
        return ParamError(field, self.message if self.rest is None else field + self.rest, self.rest)

    def with_prefix(self, old: str, new: str) -> "ParamError":
        """``renamed`` for a field path under ``old`` (``structured_outputs.json.x`` -> ``new.x``); unchanged if
        the field is not under ``old``."""
        if self.field == old or self.field.startswith(old + ".") or self.field.startswith(old + "["):
            return self.renamed(new + self.field[len(old):])
        return self


def check_int(name: str, value, low: int, high: Optional[int] = None) -> None:
    """Raise ``ParamError`` unless ``value`` is an int (not a bool) in ``[low, high]`` (``high=None``: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        rng = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ParamError.of(name, f" must be an integer {rng}, got {value!r}")


def check_number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """Raise ``ParamError`` unless ``value`` is a finite int or float (not a bool) in ``[low, high]``
    (``(low, high]`` with ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise ParamError.of(name, f" must be in {lo}{low}, {high}], got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise ``ParamError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ParamError.of(name, f" must be one of {choices}, got {value!r}")


def check_bool(name: str, value) -> None:
    """Raise ``ParamError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ParamError.of(name, f" must be true or false, got {value!r}")


def check_text(name: str, value: str) -> None:
    """Raise ``ParamError`` naming ``name`` unless ``value`` is valid Unicode text (encodable as UTF-8).

    JSON can carry a lone UTF-16 surrogate (``"\\ud800"``); it is no character, so no tokenizer, chat template or
    stop-string match can take it. Every client-controlled string that reaches those is checked here first.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError.of(name, f" is not valid Unicode text: a lone surrogate {value[e.start]!a} at character "
                                  f"{e.start} (it cannot be encoded as UTF-8)") from None
