"""``StructuredOutputsParams``: what a request's output must match (vLLM's name and fields), validated on creation."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvserve.structured.schema_check import check_json_schema
from kvserve.validation import ParamError, check_text

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    Attributes:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it.
        json_object: ``True``: the output is any JSON object.
        regex: the output matches this regular expression (whole text).
        choice: the output is exactly one of these non-empty strings.
        grammar: an EBNF grammar (xgrammar / GBNF dialect, start rule ``root``).
        structural_tag: xgrammar's structural tag (a dict or its JSON text): free text in which each region that
            opens with a tag's ``begin`` follows its JSON ``schema`` up to its ``end``. vLLM's form
            ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` or
            xgrammar's own ``{"type": "structural_tag", "format": {...}}``; checked when compiled.

    Raises:
        ValueError: none or more than one field set; a field of the wrong type; a schema that is not JSON, not an
            object, or uses a feature the backend cannot enforce (the message names the feature and its path);
            a lone surrogate in any string. Regex and grammar syntax is checked when compiled
            (``GrammarBackend.compile``, also a ``ValueError``).
    """

    json: Union[None, str, dict] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    structural_tag: Union[None, str, dict] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParamError.of("structured_outputs", f" must set exactly one of {', '.join(KINDS)}; got "
                                                      f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            self.json = _schema(self.json)
        if self.json_object is not None and self.json_object is not True:
            raise ParamError.of("structured_outputs.json_object", f" must be true, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ParamError.of(f"structured_outputs.{name}", f" must be a non-empty string, got {value!r}")
                check_text(f"structured_outputs.{name}", value)
        if self.structural_tag is not None:
            self.structural_tag = _json_object("structured_outputs.structural_tag", self.structural_tag)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ParamError.of("structured_outputs.choice", f" must be a non-empty list of non-empty strings, "
                                                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
            for c in self.choice:
                check_text("structured_outputs.choice[]", c)

    @property
    def kind(self) -> str:
        """The field that is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal constraints have equal keys (the compiled-grammar cache key)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice", "structural_tag"):
            return self.kind, _json.dumps(value, sort_keys=True, ensure_ascii=False)
        return self.kind, "" if self.kind == "json_object" else value


def _json_object(name: str, value: Any) -> dict:
    """A dict, or the JSON text of one, as a dict; raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, str):
        check_text(name, value)
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        check_text("structured_outputs.json", value)
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ParamError.of("structured_outputs.json", f" is not valid JSON: {e}") from None
    if isinstance(value, bool):  # JSON schema allows true/false; only object schemas are enforceable here
        raise ParamError.of("structured_outputs.json", " must be a JSON schema object, got a boolean schema")
    if not isinstance(value, dict):
        raise ParamError.of("structured_outputs.json", f" must be a JSON schema object, got {type(value).__name__}")
    check_json_schema(value)
    return value
