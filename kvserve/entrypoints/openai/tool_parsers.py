"""Tool calling: parsing a model's own tool-call format ("auto"), the grammar that enforces "required" and named
choices, and the streaming of calls.

A model family writes tool calls its own way; a ``ToolParser`` subclass reads that format and is registered under
a name (``register_tool_parser``), so another family adds its parser without touching the server. The default is
``HermesToolParser``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes / Qwen2.5 /
SmolLM3 convention, and the format the fallback tool prompt in ``chat_utils`` asks for).

"required" and a named ``tool_choice`` are enforced by a JSON schema (``tool_choice_schema``): a named function's
output *is* its arguments object; "required" outputs ``[{"name": ..., "arguments": {...}}, ...]``. Either way the
arguments are valid JSON under the tool's ``parameters``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ParsedToolCall:
    """One call: ``name`` and ``arguments`` (a JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ExtractedToolCalls:
    """What a model's text holds: ``content`` (text outside the calls, ``None`` when empty) and its calls."""

    content: Optional[str]
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser:
    """Reads a model family's tool-call format out of generated text.

    Subclasses set ``start_marker`` (the text that opens a call; streaming holds back text that may be its
    beginning) and implement ``extract``.
    """

    start_marker: str = ""

    def extract(self, text: str) -> ExtractedToolCalls:
        """Split ``text`` into content and calls; text that does not parse as calls stays content."""
        raise NotImplementedError


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    """Class decorator: make a ``ToolParser`` available as ``get_tool_parser(name)``."""
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls
    return deco


def get_tool_parser(name: str = "hermes") -> ToolParser:
    """A new parser registered as ``name``.

    Raises:
        ValueError: no parser of that name (the message lists the registered ones).
    """
    if name not in _PARSERS:
        raise ValueError(f"tool parser {name!r} is not registered; known: {sorted(_PARSERS)}")
    return _PARSERS[name]()


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": str, "arguments": object}</tool_call>`` blocks; the closing tag may be missing at the
    very end (generation stopped right after the JSON)."""

    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.start_marker)
        if start < 0:
            return ExtractedToolCalls(text or None)
        calls = []
        for m in self._BLOCK.finditer(text, start):
            call = _call_from_json(m.group(1))
            if call is None:
                return ExtractedToolCalls(text or None)
            calls.append(call)
        content = text[:start].strip()
        return ExtractedToolCalls(content or None, calls)


def _call_from_json(s: str) -> Optional[ParsedToolCall]:
    """``{"name", "arguments"}`` (``arguments`` an object or a JSON text of one; ``parameters`` accepted too) ->
    a call, else ``None``."""
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# ---------------------------------------------------------------------------------------------------- tool_choice
def tool_choice_schema(tools: list[dict], choice: Any, parallel_tool_calls: Optional[bool]) -> Optional[dict]:
    """The JSON schema that enforces ``choice``, or ``None`` ("none" / "auto": not constrained).

    Args:
        tools: OpenAI tools ``[{"type": "function", "function": {"name", "parameters"?}}]``.
        choice: "none", "auto", "required" or ``{"type": "function", "function": {"name"}}``.
        parallel_tool_calls: ``False``: "required" makes exactly one call.

    Raises:
        ValueError: a named function that is not among ``tools`` (message starts with ``tool_choice``).
    """
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in params:
            raise ValueError(f"tool_choice: function {name!r} is not among the tools ({sorted(params)})")
        return params[name]
    if choice != "required":
        return None
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                       "required": ["name", "arguments"]} for n, p in params.items()]}
    schema = {"type": "array", "items": item, "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def calls_from_forced(text: str, choice: Any) -> Optional[list[ParsedToolCall]]:
    """The calls of a grammar-forced output: a named choice's text is the arguments object; "required" is a list
    of ``{"name", "arguments"}``. ``None`` if the text is not complete JSON (generation hit ``max_tokens``)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, dict):
        return [ParsedToolCall(choice["function"]["name"], json.dumps(obj, ensure_ascii=False))]
    return [ParsedToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in obj]


class AutoToolStreamer:
    """Streams "auto" output: content passes through until the parser's ``start_marker`` may have begun (text
    that could be its prefix is held back); from the marker on, everything is buffered and parsed when the
    choice finishes (``finish``), exactly as the non-streamed answer is (``ToolParser.extract``)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of ``text`` sent as content
        self.in_call = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; returns the content that may be sent now."""
        self.text += delta
        if self.in_call:
            return ""
        marker = self.parser.start_marker
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0  # the longest suffix that is a prefix of the marker
        for n in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if marker.startswith(self.text[-n:]):
                keep = n
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the choice's end: ``(content still to send, calls)``. Content already sent stays; the held-back
        rest is parsed."""
        extracted = self.parser.extract(self.text)
        if not extracted.tool_calls:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        return "", extracted.tool_calls
