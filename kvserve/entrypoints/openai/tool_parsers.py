"""Tool calling: parsing a model's own tool-call format ("auto"), the grammar that enforces "required" and named
choices, and the streaming of calls.

A model family writes tool calls its own way; a ``ToolParser`` subclass reads that format and is registered under
a name (``register_tool_parser``), so another family adds its parser without touching the server. The default is
``HermesToolParser``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes / Qwen2.5 /
SmolLM3 convention, and the format the fallback tool prompt in ``chat_utils`` asks for).

"required" and a named ``tool_choice`` are enforced by a JSON schema (``tool_choice_schema``): a named function's
output *is* its arguments object; "required" outputs ``[{"name": ..., "arguments": {...}}, ...]``. Either way the
arguments are valid JSON under the tool's ``parameters`` (unless ``max_tokens`` cuts them: ``forced_calls``).

Streaming (``ForcedToolStreamer``, ``AutoToolStreamer``) is built on the same functions as the non-streamed
answer (``forced_calls``, ``ToolParser.extract``), so the streamed pieces always add up to it.
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

    @staticmethod
    def content_before_call(text: str) -> str:
        """The content of ``text``, the model's text before a call's ``start_marker``: without its trailing
        whitespace (the newline a model writes before the marker). The one rule for streamed and non-streamed
        answers (``AutoToolStreamer`` holds trailing whitespace back until it knows whether a call follows); the
        result must be a prefix of ``text``. Text without a call is content as it is."""
        return text.rstrip()


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
        return ExtractedToolCalls(self.content_before_call(text[:start]) or None, calls)


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


# ---------------------------------------------------------------------------------------------------- forced calls
_WS = re.compile(r"[ \t\n\r]*")


class JsonArrayPrefix:
    """The complete elements of a JSON array whose text grows (a grammar-forced output, cut anywhere by
    ``max_tokens``): ``update(text)`` parses from where the last call stopped, so feeding a growing text costs
    O(its length) in all. Elements must delimit themselves (objects, arrays, strings: a number at the very end of
    a cut text would look complete)."""

    def __init__(self):
        self.items: list = []
        self._pos = 0  # where parsing resumes
        self._state = "open"  # expecting "[" | an element (or "]") | "," (or "]")
        self._decoder = json.JSONDecoder()

    def update(self, text: str) -> list:
        """``text``: the whole text so far (each call's a prefix of the next). Returns the elements completed
        since the last call (also appended to ``items``)."""
        new = []
        while True:
            pos = _WS.match(text, self._pos).end()
            if pos >= len(text):
                return new
            if self._state == "open" or self._state == "sep":
                if text[pos] != ("[" if self._state == "open" else ","):
                    return new  # "]": the array is closed
                self._state, self._pos = "item", pos + 1
                continue
            if text[pos] == "]":
                return new
            try:
                item, end = self._decoder.raw_decode(text, pos)
            except ValueError:  # cut short (or not yet complete)
                return new
            self.items.append(item)
            new.append(item)
            self._state, self._pos = "sep", end


def _call_of_item(item: Any) -> ParsedToolCall:
    return ParsedToolCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False))


def forced_calls(text: str, choice: Any) -> list[ParsedToolCall]:
    """The calls of a grammar-forced output (``tool_choice_schema``), also when ``max_tokens`` cut it.

    A named choice's text is its arguments, returned as generated (the same text the stream sends piece by piece;
    cut short, it is the part generated — OpenAI's behaviour — and ``finish_reason`` says "length"). "required" is
    a list of ``{"name", "arguments"}``: every *complete* element is a call (arguments re-serialized with
    ``json.dumps``), an element cut short is dropped, so an ``arguments`` text is never invalid JSON.
    """
    if isinstance(choice, dict):
        return [ParsedToolCall(choice["function"]["name"], text)]
    array = JsonArrayPrefix()
    return [_call_of_item(item) for item in array.update(text)]


# ---------------------------------------------------------------------------------------------------- streaming
@dataclass
class ToolCallDelta:
    """A piece of a streamed call (OpenAI's ``delta.tool_calls[i]``): the first piece of call ``index`` has ``id``
    and ``name``; every piece's ``arguments`` append to the call's arguments text."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None


def whole_call_deltas(calls: list[ParsedToolCall], first_index: int = 0) -> list[ToolCallDelta]:
    """Each of ``calls`` as one delta (id, name and all its arguments), numbered from ``first_index``."""
    return [ToolCallDelta(first_index + j, c.arguments, c.id, c.name) for j, c in enumerate(calls)]


class ForcedToolStreamer:
    """Streams one choice's grammar-forced output as tool-call deltas, as OpenAI and vLLM do: a named function's
    ``head`` delta (id, name, ``arguments: ""``) goes into the choice's first chunk and every new piece of text
    is an arguments fragment; a "required" call is sent whole as soon as its list element is complete. The
    deltas concatenate to ``forced_calls`` of the whole text (the non-streamed answer)."""

    def __init__(self, choice: Any):
        self.choice = choice
        self.calls: list[ParsedToolCall] = []  # the calls begun so far
        self._text = ""
        self._array = JsonArrayPrefix()

    def head(self) -> list[ToolCallDelta]:
        """The deltas that open the stream: a named choice's call (``arguments: ""``); none for "required"."""
        if not isinstance(self.choice, dict):
            return []
        self.calls = forced_calls("", self.choice)
        return whole_call_deltas(self.calls)

    def feed(self, delta: str) -> list[ToolCallDelta]:
        """The deltas that the choice's new text ``delta`` adds."""
        if isinstance(self.choice, dict):
            if not self.calls:  # no head sent: open the call here
                return self.head() + self.feed(delta)
            return [ToolCallDelta(0, delta)] if delta else []
        self._text += delta
        new = [_call_of_item(item) for item in self._array.update(self._text)]
        out = whole_call_deltas(new, len(self.calls))
        self.calls += new
        return out


class AutoToolStreamer:
    """Streams "auto" output: content passes through until the parser's ``start_marker`` may have begun; text
    that could be the marker's prefix, and trailing whitespace (which ``ToolParser.content_before_call`` drops
    before a call), are held back. From the marker on everything is buffered and parsed when the choice finishes
    (``finish``), exactly as the non-streamed answer is (``ToolParser.extract``)."""

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
            end = at
        else:
            end = len(self.text)
            for n in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
                if marker.startswith(self.text[-n:]):  # the longest suffix that is a prefix of the marker
                    end -= n
                    break
        end = max(self.sent, len(self.parser.content_before_call(self.text[:end])))
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
