"""Tool calling: parsing a model's own tool-call format ("auto"), the grammar that enforces "required" and named
choices, and the streaming of calls.

A model family writes tool calls its own way; a ``ToolParser`` subclass reads that format and is registered under
a name (``register_tool_parser``, vLLM's names), so another family adds its parser without touching the server:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5/3, SmolLM3, and
  the format the fallback tool prompt, ``kvserve.engine.chat_render.TOOLS_PROMPT``, asks for);
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several joined by
  ``;``); ``pythonic``: ``[f(a=1), g(b="x")]``; ``mistral``: ``[TOOL_CALLS][...]`` or ``[TOOL_CALLS]f[ARGS]{...}``;
  ``granite``: ``<|tool_call|>[...]``; ``phi4_mini_json``: ``functools[...]``.

Text that does not parse as the format's calls stays content (never an error). ``parser_for_template`` picks a
parser from a chat template when that is unambiguous.

"required" and a named ``tool_choice`` are enforced by a JSON schema (``tool_choice_schema``): a named function's
output *is* its arguments object; "required" outputs ``[{"name": ..., "arguments": {...}}, ...]``. Either way the
arguments are valid JSON under the tool's ``parameters`` (unless ``max_tokens`` cuts them: ``forced_calls``).

Streaming (``ForcedToolStreamer``, ``AutoToolStreamer``) is built on the same functions as the non-streamed
answer (``forced_calls``, ``ToolParser.extract``), so the streamed pieces always add up to it.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.entrypoints.openai.reasoning_parsers import held_suffix


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

    Subclasses set where calls may begin and implement ``extract``:

    Attributes:
        markers: texts that open the calls anywhere in the output (``<tool_call>``, ``[TOOL_CALLS]`` ...); the text
            before the first one is content (``content_before_call``).
        lead_markers: texts that open the calls only at the very start of the output, leading whitespace allowed
            (Llama 3's bare ``{``, the pythonic ``[``); such an output has no content.
        template_hints: texts whose presence in a chat template says the model writes this format
            (``parser_for_template``).

    Streaming (``AutoToolStreamer``) holds back text that may begin a marker, so its pieces equal ``extract``.
    """

    markers: tuple[str, ...] = ()
    lead_markers: tuple[str, ...] = ()
    template_hints: tuple[str, ...] = ()

    @property
    def start_marker(self) -> str:
        """The first of ``markers`` (the format's call opener)."""
        return self.markers[0] if self.markers else ""

    def extract(self, text: str) -> ExtractedToolCalls:
        """Split ``text`` into content and calls; text that does not parse as calls stays content."""
        raise NotImplementedError

    @staticmethod
    def content_before_call(text: str) -> str:
        """The content of ``text``, the model's text before a call's marker: without its trailing
        whitespace (the newline a model writes before the marker). The one rule for streamed and non-streamed
        answers (``AutoToolStreamer`` holds trailing whitespace back until it knows whether a call follows); the
        result must be a prefix of ``text``. Text without a call is content as it is."""
        return text.rstrip()

    def call_start(self, text: str) -> int:
        """Where the calls begin in ``text``: 0 when it opens with a ``lead_markers`` text, else the first of
        ``markers``; -1 when neither."""
        if any(text.lstrip().startswith(m) for m in self.lead_markers):
            return 0
        hits = [i for m in self.markers for i in [text.find(m)] if i >= 0]
        return min(hits) if hits else -1

    def split(self, text: str, parse) -> ExtractedToolCalls:
        """``extract`` for formats whose calls run from ``call_start`` to the end: ``parse(region)`` -> the calls,
        or ``None`` when the region does not parse (then the whole text is content)."""
        start = self.call_start(text)
        if start < 0:
            return ExtractedToolCalls(text or None)
        calls = parse(text[start:])
        if not calls:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(self.content_before_call(text[:start]) or None, calls)


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

    markers = ("<tool_call>",)
    template_hints = ("<tool_call>",)
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
    """``{"name", "arguments"}`` JSON text -> a call, else ``None`` (``_call_from_obj``)."""
    try:
        return _call_from_obj(json.loads(s))
    except ValueError:
        return None


def _call_from_obj(obj: Any) -> Optional[ParsedToolCall]:
    """``{"name": str, "arguments": object}`` (``arguments`` may be a JSON text of an object; ``parameters``, Llama
    3's key, accepted too) -> a call, else ``None``."""
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


_DECODER = json.JSONDecoder()


def _json_values(text: str, sep: Optional[str] = None) -> Optional[list]:
    """The JSON values that make up all of ``text`` (whitespace around them; ``sep`` between them when several are
    allowed), or ``None`` when ``text`` is anything else."""
    values, pos = [], 0
    while True:
        pos = _WS.match(text, pos).end()
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        pos = _WS.match(text, pos).end()
        if pos == len(text):
            return values
        if sep is None or text[pos] != sep:
            return None
        pos += 1


def _calls_of(objs: Optional[list]) -> Optional[list[ParsedToolCall]]:
    """Every object of ``objs`` as a call (``_call_from_obj``), or ``None`` if one is not a call."""
    if not objs:
        return None
    calls = [_call_from_obj(o) for o in objs]
    return None if any(c is None for c in calls) else calls


def _json_array_calls(text: str) -> Optional[list[ParsedToolCall]]:
    """``[{"name", "arguments"}, ...]`` (all of ``text``, whitespace around) -> calls, else ``None``."""
    values = _json_values(text)
    return _calls_of(values[0]) if values and isinstance(values[0], list) else None


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: ``{"name": str, "parameters": object}`` (``arguments`` accepted too), the whole
    output or after ``<|python_tag|>``; several separated by ``;``."""

    markers = ("<|python_tag|>",)
    lead_markers = ("{",)
    template_hints = ("<|python_tag|>",)

    def extract(self, text: str) -> ExtractedToolCalls:
        def parse(region: str):
            region = region.lstrip().removeprefix("<|python_tag|>")
            return _calls_of(_json_values(region, sep=";"))
        return self.split(text, parse)


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Python call syntax, the whole output a list: ``[get_weather(city="Paris"), f(x=1)]`` (Llama 3.2 / 4 and
    others); keyword arguments only, their values Python literals (``ast.literal_eval``), returned as JSON."""

    lead_markers = ("[",)
    template_hints = ("func_name1(",)

    def extract(self, text: str) -> ExtractedToolCalls:
        return self.split(text, _pythonic_calls)


def _pythonic_calls(region: str) -> Optional[list[ParsedToolCall]]:
    try:
        tree = ast.parse(region.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON-serializable (a set, bytes)
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        calls.append(ParsedToolCall(node.func.id, arguments))
    return calls


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]``: a JSON array ``[{"name", "arguments"}, ...]`` (older tokenizers), or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` form, one ``[TOOL_CALLS]`` per call (``[CALL_ID]id`` before ``[ARGS]``
    accepted)."""

    markers = ("[TOOL_CALLS]",)
    template_hints = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")

    def extract(self, text: str) -> ExtractedToolCalls:
        def parse(region: str):
            calls = []
            for segment in region.split("[TOOL_CALLS]")[1:]:
                m = self._NAMED.match(segment)
                if m is None:
                    more = _json_array_calls(segment)
                else:
                    values = _json_values(segment[m.end():])
                    more = _calls_of([{"name": m.group(1), "arguments": values[0]}]) if values else None
                if more is None:
                    return None
                calls += more
            return calls
        return self.split(text, parse)


@register_tool_parser("granite")
class GraniteToolParser(ToolParser):
    """IBM Granite 3.x: ``<|tool_call|>`` then a JSON array ``[{"name", "arguments"}, ...]``."""

    markers = ("<|tool_call|>",)
    template_hints = ("<|tool_call|>",)

    def extract(self, text: str) -> ExtractedToolCalls:
        return self.split(text, lambda region: _json_array_calls(region[len("<|tool_call|>"):]))


@register_tool_parser("phi4_mini_json")
class Phi4MiniJsonToolParser(ToolParser):
    """Phi-4-mini: ``functools[{"name", "arguments"}, ...]`` (``parameters`` accepted too)."""

    markers = ("functools[",)
    template_hints = ("functools",)

    def extract(self, text: str) -> ExtractedToolCalls:
        return self.split(text, lambda region: _json_array_calls(region[len("functools"):]))


def parser_for_template(template: Optional[str]) -> tuple[Optional[str], str]:
    """The tool parser a chat template implies: ``(name, why)``, ``name`` ``None`` when it is ambiguous.

    One parser whose ``template_hints`` the template contains: that one. A template that does not know tools:
    ``hermes`` (``chat_render.render_chat`` then asks for Hermes calls in the system prompt). Otherwise (none or
    several match): ``None``, and ``--tool-call-parser`` must say.
    """
    if not template:
        return "hermes", "no chat template: the fallback tool prompt asks for Hermes calls"
    if "tools" not in template:
        return "hermes", "the chat template does not render tools: the fallback tool prompt asks for Hermes calls"
    found = sorted(n for n, cls in _PARSERS.items() if any(h in template for h in cls.template_hints))
    if len(found) == 1:
        hints = [h for h in _PARSERS[found[0]].template_hints if h in template]
        return found[0], f"the chat template mentions {hints[0]!r}"
    return None, (f"the chat template matches several formats ({', '.join(found)})" if found else
                  "the chat template names no known tool-call format")


def tool_parser_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_PARSERS)


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
    """Streams "auto" output: content passes through until one of the parser's ``markers`` may have begun (or, with
    ``lead_markers``, while the output may still open with one); text that could be a marker's prefix, and trailing whitespace (which ``ToolParser.content_before_call`` drops
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
        p = self.parser
        if self.sent == 0 and p.lead_markers:
            body = self.text.lstrip()
            if any(m.startswith(body) or body.startswith(m) for m in p.lead_markers):
                self.in_call = any(body.startswith(m) for m in p.lead_markers)
                return ""  # the calls may open the output: nothing is content until they are parsed
        at = p.call_start(self.text)
        if at >= 0:
            self.in_call = True
            end = at
        else:
            end = len(self.text) - (held_suffix(self.text[self.sent:], p.markers) if p.markers else 0)
        end = max(self.sent, len(p.content_before_call(self.text[:end])))
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


_HARMONY_CALL = re.compile(r"(?P<header>(?:<\|start\|>|<\|channel\|>)(?:(?!<\|message\|>).)*)<\|message\|>"
                           r"(?P<body>(?:(?!<\|(?:end|call|return|start)\|>).)*)(?:<\|(?:end|call|return)\|>)?",
                           re.DOTALL)


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    """gpt-oss's harmony tool calls: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|>`` (the recipient may also follow the role: ``<|start|>assistant to=functions.NAME<|channel|>commentary
    json<|message|>``); several may follow each other. The calls run from the first message addressed to
    ``functions.*`` to the end; each such message's body must be a JSON object (its arguments), else the whole text
    is content. Messages in that region addressed to no function (a ``final`` answer after a call) are dropped,
    as the streamed answer drops them (``AutoToolStreamer``). The markers are special tokens: ``special_tokens``."""

    markers = ("<|start|>assistant<|channel|>commentary to=functions.", "<|channel|>commentary to=functions.",
               "<|start|>assistant to=functions.")
    template_hints = ("<|call|>",)
    special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        from kvserve.entrypoints.openai.reasoning_parsers import harmony_header

        def parse(region: str):
            calls = []
            for m in _HARMONY_CALL.finditer(region):
                _, recipient = harmony_header(m.group("header"))
                if recipient is None or not recipient.startswith("functions."):
                    continue
                try:
                    args = json.loads(m.group("body"))
                except ValueError:
                    return None
                if not isinstance(args, dict):
                    return None
                calls.append(ParsedToolCall(recipient[len("functions."):], json.dumps(args, ensure_ascii=False)))
            return calls or None

        return self.split(text, parse)
