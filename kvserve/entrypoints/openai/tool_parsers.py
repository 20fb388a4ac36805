"""Tool calling: parsing a model's own tool-call format ("auto"), the grammar that enforces "required" and named
choices, and the streaming of calls.

A model family writes tool calls its own way; a ``ToolParser`` subclass reads that format and is registered under
a name (``register_tool_parser``, vLLM's names), so another family adds its parser without touching the server:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5/3, SmolLM3, and
  the format the fallback tool prompt, ``kvserve.engine.chat_render.TOOLS_PROMPT``, asks for);
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several joined by
  ``;``); ``pythonic``: ``[f(a=1), g(b="x")]``; ``mistral``: ``[TOOL_CALLS][...]`` or ``[TOOL_CALLS]f[ARGS]{...}``;
  ``granite``: ``<|tool_call|>[...]``; ``phi4_mini_json``: ``functools[...]``.

The calls are read by ``tool_scan.scan``, one left-to-right reader for the streamed and the non-streamed answer:
content flows until a marker; a call commits once its name and the start of its arguments are read, then its
arguments stream as fragments; text that stops fitting the format before a commit stays content (never an error),
after a commit the call keeps the arguments read so far and the rest is content (``tool_scan``'s docstring).
``parser_for_template`` picks a parser from a chat template when that is unambiguous.

"required" and a named ``tool_choice`` are grammar-enforced. With the server's explicit ``--tool-call-parser``, in
that parser's format (``ToolParser.choice_constraint``: an xgrammar structural tag from ``call_format``; pythonic's
an EBNF, ``pythonic_grammar``), the output read back by the same parser. Otherwise by a JSON
schema (``tool_choice_schema``): a named function's output *is* its arguments object; "required" outputs
``[{"name": ..., "arguments": {...}}, ...]`` (``forced_calls``, ``ForcedToolStreamer``). Either way the arguments
are valid JSON under the tool's ``parameters`` unless ``max_tokens`` cuts them.

Streaming (``ForcedToolStreamer``, ``AutoToolStreamer``) is built on the same functions as the non-streamed
answer (``forced_calls``, ``tool_scan.scan``), so the streamed pieces always add up to it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.entrypoints.openai import tool_scan as ts
from kvserve.entrypoints.openai.pythonic_grammar import pythonic_grammar


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

    Subclasses set where calls may begin and implement ``read_calls`` (one call region, on a
    ``tool_scan.Reader``); ``extract`` and the stream (``AutoToolStreamer``) both run ``tool_scan.scan`` over it,
    so the streamed pieces join to the non-streamed answer at every cut point.

    Attributes:
        markers: texts that open the calls anywhere in the output (``<tool_call>``, ``[TOOL_CALLS]`` ...); the text
            before the first one is content (``content_before_call``).
        lead_markers: characters that open the calls only at the very start of the output, leading whitespace
            allowed (Llama 3's bare ``{``, the pythonic ``[``).
        template_hints: texts whose presence in a chat template says the model writes this format
            (``parser_for_template``).
        call_format: ``(opener, call begin, call end, separator, closer)``, the exact text a grammar-enforced
            ``tool_choice`` writes (``tool_choice_tag``; ``NAME`` in the call begin is the function's name as a JSON
            string, the arguments object follows it), or ``None``: no grammar in this format (the JSON path).
    """

    markers: tuple[str, ...] = ()
    lead_markers: tuple[str, ...] = ()
    template_hints: tuple[str, ...] = ()
    call_format: Optional[tuple[str, str, str, str, str]] = None

    @property
    def start_marker(self) -> str:
        """The first of ``markers`` (the format's call opener)."""
        return self.markers[0] if self.markers else ""

    def read_calls(self, r: ts.Reader) -> None:
        """Read one call region at ``r.pos`` (a marker, or a lead character), committing its calls
        (``r.commit``); raises ``ts.NoFit`` / ``ts.NeedMore`` (``tool_scan``)."""
        raise NotImplementedError

    def choice_constraint(self, tools: list[dict], choice: Any,
                          parallel_tool_calls: Optional[bool]) -> Optional[dict]:
        """The ``StructuredOutputsParams`` fields that enforce a forced ``choice`` ("required" or named) in this
        format (``tool_choice_tag``), or ``None``: no grammar of its own (the JSON path).

        Raises:
            ValueError: a named function that is not among ``tools``.
        """
        tag = tool_choice_tag(self, tools, choice, parallel_tool_calls)
        return None if tag is None else {"structural_tag": tag}

    def extract(self, text: str) -> ExtractedToolCalls:
        """Split a whole output ``text`` into content and calls (the rule: ``tool_scan``'s docstring)."""
        parts = ts.scan(self, text, final=True)
        content = "".join(x for x in parts if isinstance(x, str))
        return ExtractedToolCalls(content or None, [ParsedToolCall(c.name, c.arguments) for c in parts
                                                    if isinstance(c, ts.ScannedCall)])

    @staticmethod
    def content_before_call(text: str) -> str:
        """The content of ``text``, the model's text before a call's marker: without its trailing
        whitespace (the newline a model writes before the marker). The one rule for streamed and non-streamed
        answers (the stream holds trailing whitespace back until it knows whether a call follows); the result
        must be a prefix of ``text``."""
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

    markers = ("<tool_call>",)
    template_hints = ("<tool_call>",)
    call_format = ("", '<tool_call>\n{"name": NAME, "arguments": ', "}\n</tool_call>", "\n", "")

    def read_calls(self, r: ts.Reader) -> None:
        r.expect("<tool_call>")
        r.ws()
        ts.json_call(r)
        r.ws()
        if not r.eof() and r.accept("</tool_call>"):
            r.mark = r.pos


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: ``{"name": str, "parameters": object}`` (``arguments`` accepted too), the whole
    output or after ``<|python_tag|>``; several separated by ``;``."""

    markers = ("<|python_tag|>",)
    lead_markers = ("{",)
    template_hints = ("<|python_tag|>",)
    call_format = ("", '{"name": NAME, "parameters": ', "}", "; ", "")

    def read_calls(self, r: ts.Reader) -> None:
        r.accept("<|python_tag|>")
        while True:
            r.ws()
            ts.json_call(r)
            r.ws()
            if r.eof() or not r.accept(";"):
                return
            r.ws()
            r.mark = r.pos


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Python call syntax, the whole output a list: ``[get_weather(city="Paris"), f(x=1)]`` (Llama 3.2 / 4 and
    others); keyword arguments only, their values Python literals (``ast.literal_eval``), returned as JSON
    (``tool_scan.python_call_list``: one fragment per keyword argument)."""

    lead_markers = ("[",)
    template_hints = ("func_name1(",)

    def read_calls(self, r: ts.Reader) -> None:
        ts.python_call_list(r)

    def choice_constraint(self, tools: list[dict], choice: Any,
                          parallel_tool_calls: Optional[bool]) -> Optional[dict]:
        """An EBNF of ``[f(a=...)]`` calls (``pythonic_grammar``); ``None`` (the JSON path) when a name is not a
        Python identifier or a schema does not convert (the JSON path then reports it)."""
        if tool_choice_schema(tools, choice, parallel_tool_calls) is None:
            return None
        names = [choice["function"]["name"]] if isinstance(choice, dict) else [t["function"]["name"] for t in tools]
        try:
            ebnf = pythonic_grammar(tools, names, isinstance(choice, dict) or parallel_tool_calls is False)
        except (ImportError, ValueError, RuntimeError):
            return None
        return None if ebnf is None else {"grammar": ebnf}


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]``: a JSON array ``[{"name", "arguments"}, ...]`` (older tokenizers), or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` form, one ``[TOOL_CALLS]`` per call (``[CALL_ID]id`` before ``[ARGS]``
    accepted)."""

    markers = ("[TOOL_CALLS]",)
    template_hints = ("[TOOL_CALLS]",)
    call_format = ("[TOOL_CALLS][", '{"name": NAME, "arguments": ', "}", ", ", "]")

    def read_calls(self, r: ts.Reader) -> None:
        r.expect("[TOOL_CALLS]")
        r.ws()
        if not r.eof() and r.text[r.pos] == "[":
            ts.json_call_list(r)
            return
        name = r.word(lambda ch: ch.isalnum() or ch in "_.-")
        if r.accept("[CALL_ID]"):
            r.word(str.isalnum)
        r.expect("[ARGS]")
        r.ws()
        if r.eof() or r.text[r.pos] != "{":
            raise ts.NoFit
        ts.json_value(r, r.commit(name))
        r.mark = r.pos


@register_tool_parser("granite")
class GraniteToolParser(ToolParser):
    """IBM Granite 3.x: ``<|tool_call|>`` then a JSON array ``[{"name", "arguments"}, ...]``."""

    markers = ("<|tool_call|>",)
    template_hints = ("<|tool_call|>",)
    call_format = ("<|tool_call|>[", '{"name": NAME, "arguments": ', "}", ", ", "]")

    def read_calls(self, r: ts.Reader) -> None:
        r.expect("<|tool_call|>")
        ts.json_call_list(r)


@register_tool_parser("phi4_mini_json")
class Phi4MiniJsonToolParser(ToolParser):
    """Phi-4-mini: ``functools[{"name", "arguments"}, ...]`` (``parameters`` accepted too)."""

    markers = ("functools[",)
    template_hints = ("functools",)
    call_format = ("functools[", '{"name": NAME, "arguments": ', "}", ", ", "]")

    def read_calls(self, r: ts.Reader) -> None:
        r.expect("functools")
        ts.json_call_list(r)


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


def tool_choice_tag(parser: ToolParser, tools: list[dict], choice: Any,
                    parallel_tool_calls: Optional[bool]) -> Optional[dict]:
    """The xgrammar structural tag that enforces ``choice`` in ``parser``'s own format (``ToolParser.call_format``),
    or ``None`` when the format has none (pythonic) or ``choice`` is not forced. "required": one or more calls
    (exactly one with ``parallel_tool_calls`` ``False``), each the format's call of one of ``tools`` with arguments
    valid under its ``parameters``; a named function: one call of it. The text it writes is what ``parser`` reads.

    Raises:
        ValueError: a named function that is not among ``tools`` (``tool_choice_schema``'s message).
    """
    schema = tool_choice_schema(tools, choice, parallel_tool_calls)
    if schema is None or parser.call_format is None:
        return None
    opener, begin, end, separator, closer = parser.call_format
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    names = [choice["function"]["name"]] if isinstance(choice, dict) else list(params)
    tags = [{"type": "tag", "begin": begin.replace("NAME", json.dumps(n, ensure_ascii=False)),
             "content": {"type": "json_schema", "json_schema": params[n]}, "end": end} for n in names]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
             "stop_after_first": isinstance(choice, dict) or parallel_tool_calls is False}
    elements = [{"type": "const_string", "value": opener}] if opener else []
    elements += [calls] + ([{"type": "const_string", "value": closer}] if closer else [])
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


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
    """Streams "auto" output as it is generated: each ``feed`` scans the text so far (``tool_scan.scan``) and
    returns what its parts add to those already sent, in order: content (``str``) and ``ToolCallDelta``s (a call's
    first piece has its id and name and the arguments read so far, then argument fragments). The scan of a text is
    a prefix of the scan of any longer one, so the pieces join to ``ToolParser.extract`` of the whole text (the
    non-streamed answer: ``events.ChoiceEvents`` feeds it as one piece)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""  # everything generated so far
        self.sent: list = []  # the parts sent: str | [name, arguments]
        self.ids: list[str] = []  # the calls' ids, by index
        self._cache: dict = {}

    def feed(self, delta: str, final: bool = False) -> list:
        """Add ``delta`` (``final``: the choice ends with it); returns the pieces to send now."""
        self.text += delta
        parts = ts.scan(self.parser, self.text, final, self._cache)
        out: list = []
        ncalls = 0
        for i, part in enumerate(parts):
            is_call = isinstance(part, ts.ScannedCall)
            if i < len(self.sent):
                old = self.sent[i]
                if is_call:
                    ncalls += 1
                    grown = part.arguments[len(old[1]):]
                    if grown:
                        out.append(ToolCallDelta(ncalls - 1, grown))
                        old[1] = part.arguments
                elif len(part) > len(old):
                    out.append(part[len(old):])
                    self.sent[i] = part
                continue
            if is_call:
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                out.append(ToolCallDelta(ncalls, part.arguments, self.ids[ncalls], part.name))
                self.sent.append([part.name, part.arguments])
                ncalls += 1
            else:
                out.append(part)
                self.sent.append(part)
        return out

    @property
    def called(self) -> bool:
        """Whether a call has been sent."""
        return bool(self.ids)


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    """gpt-oss's harmony tool calls: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|>`` (the recipient may also follow the role: ``<|start|>assistant to=functions.NAME<|channel|>commentary
    json<|message|>``). One call per region; the scan finds the next one after it. The call commits at its
    arguments' ``{`` (``tool_scan``'s rule); its end token (``<|call|>``, or ``<|end|>``) may be missing at the very
    end. The markers are special tokens: ``special_tokens`` (the server keeps them in the text)."""

    markers = ("<|start|>assistant<|channel|>commentary to=functions.", "<|channel|>commentary to=functions.",
               "<|start|>assistant to=functions.")
    template_hints = ("<|call|>",)
    special_tokens = True

    def read_calls(self, r: ts.Reader) -> None:
        if not any(r.accept(m) for m in self.markers):
            raise ts.NoFit
        name = r.word(lambda ch: ch.isalnum() or ch in "_.-")
        end = r.text.find("<|message|>", r.pos)
        if end < 0:
            if r.final:
                raise ts.NoFit
            raise ts.NeedMore
        if any(t in r.text[r.pos:end] for t in ("<|start|>", "<|end|>", "<|call|>", "<|return|>")):
            raise ts.NoFit  # the header of another message: this one carried no arguments
        r.pos = end + len("<|message|>")
        r.ws()
        if r.eof() or r.text[r.pos] != "{":
            raise ts.NoFit
        ts.json_value(r, r.commit(name))
        r.ws()
        if not r.eof() and not (r.accept("<|call|>") or r.accept("<|end|>")):
            raise ts.NoFit
        r.mark = r.pos
