"""Reasoning parsers: the model's thinking separated from its answer, registered by vLLM's names.

A thinking model writes its reasoning between markers before the answer: ``<think>...</think>`` (DeepSeek-R1,
Qwen3, SmolLM3), or Granite's ``Here is my thought process: ... Here is my response: ...``. A ``ReasoningParser``
splits a finished text into ``(reasoning, content)`` (``extract``) and a streamed text delta by delta
(``streamer()``); the streamer's pieces joined per kind always equal ``extract`` of the whole text, wherever the
deltas are cut, because a piece that may be the beginning of a marker is held back until the next delta (or the
end) decides it. Empty parts are ``None``, as vLLM returns them.

Where reasoning starts (a parser's ``starts_in_reasoning``) depends on the prompt as much as on the output:

- ``deepseek_r1`` (vLLM's rule): the output is reasoning until ``</think>``; a ``<think>`` the model writes itself
  is dropped. No ``</think>`` at all: everything is reasoning (the answer was cut while thinking).
- ``qwen3``: as ``deepseek_r1``, unless thinking is off: ``chat_template_kwargs={"enable_thinking": false}``, or
  a prompt whose last ``<think>`` is already closed (Qwen3's template writes ``<think>\\n\\n</think>`` into the
  prompt when thinking is off). Then the whole output is content.
- ``smollm3``: SmolLM3's template: thinking is off with ``enable_thinking: false`` or ``/no_think`` in the system
  prompt (the template then closes an empty ``<think>`` in the prompt); else as ``deepseek_r1``.
- an output a grammar constrains from its first token (``constrained``: structured outputs) with thinking on
  starts in the content whatever the prompt says; a grammar that writes the start marker first (a regex ``<think>...``) opens the
  reasoning there.
- ``granite``: reasoning is the text after ``Here is my thought process:`` (or ``Here's ...``) at the start of the
  output, up to ``Here is my response:`` (or ``Here's ...``); an output that does not start so is all content.

The markers' texts (``ReasoningParser.markers``) are also what the thinking budget forces
(``SamplingParams.thinking_token_budget``, ``kvserve.sample.thinking``).
"""

from __future__ import annotations

from typing import Optional

#: ``(kind, text)`` pieces of a streamed answer: kind ``"reasoning"`` or ``"content"``.
Piece = tuple[str, str]


class ReasoningParser:
    """Splits a model's text into reasoning and content.

    Attributes:
        mode: where the output begins: ``"reasoning"``, ``"content"``, or ``"lead"`` (in the reasoning only when
            the output opens with the start marker); decided from the prompt, the request's ``chat_template_kwargs``
            and ``constrained`` when the parser is made (``get_reasoning_parser``).
        starts_in_reasoning: ``mode == "reasoning"``.
        markers: ``(start, end)`` texts that open and close the reasoning (the end one is forced by a thinking
            budget).
    """

    markers: tuple[str, str] = ("<think>", "</think>")

    def __init__(self, prompt: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
                 constrained: bool = False):
        thinking = self.thinking_on(prompt or "", chat_template_kwargs or {})
        self.mode = "content" if not thinking else "lead" if constrained else "reasoning"
        self.starts_in_reasoning = self.mode == "reasoning"

    def thinking_on(self, prompt: str, chat_template_kwargs: dict) -> bool:
        """Whether the output starts in the reasoning, for this ``prompt`` text and ``chat_template_kwargs``."""
        return True

    @property
    def open_at_start(self) -> bool:
        """Whether the output's first token is already reasoning (what a thinking budget counts from:
        ``SamplingParams.reasoning_open``)."""
        return self.starts_in_reasoning

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """``(reasoning, content)`` of a finished ``text``; an empty part is ``None``."""
        raise NotImplementedError

    def streamer(self) -> "ReasoningStreamer":
        """A fresh streamer of one answer (``feed`` each text delta, then ``finish``)."""
        raise NotImplementedError


class ReasoningStreamer:
    """Splits one streamed answer: ``feed(delta)`` returns the ``(kind, text)`` pieces that may be sent now (text
    that may begin a marker is held back), ``finish()`` the rest. Joined per kind they equal the parser's
    ``extract`` of the whole text."""

    def feed(self, delta: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError


def held_suffix(text: str, markers: tuple) -> int:
    """The length of the longest proper suffix of ``text`` that begins one of ``markers`` (text a later delta may
    complete into a marker)."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return n
    return 0


def _pieces(kind: str, text: str) -> list[Piece]:
    return [(kind, text)] if text else []


# ---------------------------------------------------------------------------------------------------- <think>
class ThinkParser(ReasoningParser):
    """``<think>reasoning</think>content``: the ``deepseek_r1`` rule (see the module docstring). In reasoning, a
    ``<think>`` before the first ``</think>`` is dropped (the template or the model opened it); after
    ``</think>`` everything is content, markers included."""

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        start, end = self.markers
        if self.mode == "content" or (self.mode == "lead" and not text.startswith(start)):
            return None, text or None
        j = text.find(end)
        reasoning, content = (text, "") if j < 0 else (text[:j], text[j + len(end):])
        i = reasoning.find(start)
        if i >= 0:
            reasoning = reasoning[:i] + reasoning[i + len(start):]
        return reasoning or None, content or None

    def streamer(self) -> ReasoningStreamer:
        return _ThinkStreamer(self.markers, self.mode)


class _ThinkStreamer(ReasoningStreamer):
    def __init__(self, markers: tuple[str, str], mode: str):
        self.start, self.end = markers
        self.undecided = mode == "lead"  # waiting to see whether the output opens with the start marker
        self.in_reasoning = mode != "content"
        self.seen_start = False
        self.buf = ""

    def feed(self, delta: str) -> list[Piece]:
        if not self.in_reasoning:
            return _pieces("content", delta)
        self.buf += delta
        if self.undecided:
            if self.start.startswith(self.buf) and self.buf != self.start:
                return []  # may still become the start marker
            self.undecided = False
            if not self.buf.startswith(self.start):
                self.in_reasoning, rest, self.buf = False, self.buf, ""
                return _pieces("content", rest)
        out: list[Piece] = []
        while self.in_reasoning:
            j = self.buf.find(self.end)
            i = -1 if self.seen_start else self.buf.find(self.start)
            if i >= 0 and (j < 0 or i < j):  # the opening marker: dropped
                out += _pieces("reasoning", self.buf[:i])
                self.buf, self.seen_start = self.buf[i + len(self.start):], True
            elif j >= 0:
                out += _pieces("reasoning", self.buf[:j])
                rest, self.buf, self.in_reasoning = self.buf[j + len(self.end):], "", False
                out += _pieces("content", rest)
            else:
                markers = (self.end,) if self.seen_start else (self.start, self.end)
                keep = held_suffix(self.buf, markers)
                out += _pieces("reasoning", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
        return out

    def finish(self) -> list[Piece]:
        rest, self.buf = self.buf, ""
        return _pieces("reasoning" if self.in_reasoning and not self.undecided else "content", rest)


_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str):
    """Class decorator: make a ``ReasoningParser`` available as ``get_reasoning_parser(name)``."""
    def deco(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls
    return deco


def reasoning_parser_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str, prompt: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
                         constrained: bool = False) -> ReasoningParser:
    """A new parser registered as ``name``, for one request: ``prompt`` is its prompt text (the rendered chat
    template) and ``chat_template_kwargs`` the request's, which decide whether the output starts in the reasoning;
    ``constrained``: a grammar shapes the output from its first token (then only a leading start marker opens it).

    Raises:
        ValueError: no parser of that name (the message lists the registered ones).
    """
    if name not in _PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not registered; known: {reasoning_parser_names()}")
    return _PARSERS[name](prompt, chat_template_kwargs, constrained)


def _closed_in_prompt(prompt: str, markers: tuple[str, str]) -> bool:
    """The prompt's last reasoning is already closed: its last end marker follows its last start marker (a
    template that turned thinking off writes an empty one)."""
    start, end = markers
    j = prompt.rfind(end)
    return j >= 0 and j > prompt.rfind(start)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkParser):
    """DeepSeek-R1: always thinks; the output is reasoning until ``</think>``."""


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkParser):
    """Qwen3: as ``deepseek_r1`` unless ``enable_thinking`` is false or the prompt already closed the think."""

    def thinking_on(self, prompt: str, chat_template_kwargs: dict) -> bool:
        if chat_template_kwargs.get("enable_thinking", True) is False:
            return False
        return not _closed_in_prompt(prompt, self.markers)


@register_reasoning_parser("smollm3")
class SmolLM3ReasoningParser(ThinkParser):
    """SmolLM3: thinking is off with ``enable_thinking: false`` or ``/no_think`` in the system prompt (the
    template's extended-thinking flags ``/think`` and ``/no_think``), or when the prompt closed the think."""

    def thinking_on(self, prompt: str, chat_template_kwargs: dict) -> bool:
        if chat_template_kwargs.get("enable_thinking", True) is False:
            return False
        if prompt.rfind("/no_think") > prompt.rfind("/think"):
            return False
        return not _closed_in_prompt(prompt, self.markers)


# ---------------------------------------------------------------------------------------------------- granite
_GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
_GRANITE_ENDS = ("Here is my response:", "Here's my response:")


def _find_any(text: str, markers: tuple, start: int = 0) -> tuple[int, str]:
    """The earliest occurrence of any of ``markers`` in ``text`` from ``start``: ``(index, marker)``, or
    ``(-1, "")``."""
    hits = [(i, m) for m in markers for i in [text.find(m, start)] if i >= 0]
    return min(hits) if hits else (-1, "")


@register_reasoning_parser("granite")
class GraniteReasoningParser(ReasoningParser):
    """IBM Granite 3.2+: ``Here is my thought process: ... Here is my response: ...`` (``Here's`` accepted for
    both, as vLLM does). The thought-process marker must open the output (leading whitespace allowed); a missing
    response marker leaves everything after it reasoning."""

    markers = ("Here is my thought process:", "Here is my response:")

    @property
    def open_at_start(self) -> bool:
        """Granite's reasoning opens only with its own marker at the start of the output."""
        return False

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        body = text.lstrip()
        head = next((m for m in _GRANITE_STARTS if body.startswith(m)), None)
        if head is None:
            return None, text or None
        body = body[len(head):]
        j, marker = _find_any(body, _GRANITE_ENDS)
        reasoning, content = (body, "") if j < 0 else (body[:j], body[j + len(marker):])
        return reasoning or None, content or None

    def streamer(self) -> ReasoningStreamer:
        return _GraniteStreamer()


class _GraniteStreamer(ReasoningStreamer):
    def __init__(self):
        self.state = "start"  # "start" (undecided) | "reasoning" | "content"
        self.buf = ""

    def feed(self, delta: str) -> list[Piece]:
        if self.state == "content":
            return _pieces("content", delta)
        self.buf += delta
        if self.state == "start":
            body = self.buf.lstrip()
            head = next((m for m in _GRANITE_STARTS if body.startswith(m)), None)
            if head is None:
                if any(m.startswith(body) for m in _GRANITE_STARTS):
                    return []  # may still become the marker
                self.state, rest, self.buf = "content", self.buf, ""
                return _pieces("content", rest)
            self.state, self.buf = "reasoning", body[len(head):]
        j, marker = _find_any(self.buf, _GRANITE_ENDS)
        if j >= 0:
            out = _pieces("reasoning", self.buf[:j]) + _pieces("content", self.buf[j + len(marker):])
            self.state, self.buf = "content", ""
            return out
        keep = held_suffix(self.buf, _GRANITE_ENDS)
        out = _pieces("reasoning", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> list[Piece]:
        rest, self.buf = self.buf, ""
        return _pieces("reasoning" if self.state == "reasoning" else "content", rest)


# ---------------------------------------------------------------------------------------------------- harmony
#: The harmony format's framing (gpt-oss; OpenAI's "harmony response format"): every message is
#: ``<|start|>ROLE<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY`` ended by ``<|end|>``,
#: ``<|call|>`` (a tool call) or ``<|return|>`` (the answer's end). An assistant turn's output begins after the
#: prompt's ``<|start|>assistant``, so its first message opens at ``<|channel|>``.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_HARMONY_OPEN = ("<|start|>", "<|channel|>")
_HARMONY_CLOSE = ("<|end|>", "<|call|>", "<|return|>")


def harmony_header(header: str) -> tuple[str, Optional[str]]:
    """``(channel, recipient or None)`` of a harmony message header (the text before ``<|message|>``, framing
    included): ``<|channel|>commentary to=functions.f <|constrain|>json`` -> ``("commentary", "functions.f")``; the
    recipient may also follow the role (``<|start|>assistant to=functions.f<|channel|>commentary json``)."""
    channel = ""
    if "<|channel|>" in header:
        channel = header.split("<|channel|>", 1)[1].split("<|", 1)[0].split()
        channel = channel[0] if channel else ""
    recipient = None
    for word in header.replace("<|", " <|").split():
        if word.startswith("to="):
            recipient = word[3:]
    return channel, recipient


class HarmonySplitter:
    """Splits a streamed harmony output into ``(kind, text)`` pieces, one character at a time in effect (the result
    does not depend on where the deltas are cut): the bodies of ``analysis`` messages are ``"reasoning"``, of
    ``final`` messages ``"content"``; any other message (``commentary``: tool calls, preambles) passes through as
    ``"content"`` whole, framing included, for a tool parser (``openai``) to read; text outside any message is
    content. A message's header is held until its ``<|message|>`` decides it, and text that may begin a marker until
    the next delta; ``finish`` flushes an unfinished header as content."""

    def __init__(self):
        self.buf = ""
        self.state = "top"  # "top" (between messages) | "header" | "body"
        self.header = ""
        self.kind = "content"  # the open body's kind: "reasoning", "content" (final) or "raw" (passed through)

    def feed(self, delta: str) -> list[Piece]:
        self.buf += delta
        out: list[Piece] = []
        while self.buf:
            hits = [(i, m) for m in HARMONY_MARKERS for i in [self.buf.find(m)] if i >= 0]
            if not hits:
                keep = held_suffix(self.buf, HARMONY_MARKERS)
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                out += self._text(text)
                break
            i, marker = min(hits)
            out += self._text(self.buf[:i])
            self.buf = self.buf[i + len(marker):]
            out += self._marker(marker)
        return out

    def finish(self) -> list[Piece]:
        rest, self.buf = self.buf, ""
        out = self._text(rest)
        if self.state == "header":
            out += _pieces("content", self.header)
            self.header, self.state = "", "top"
        return out

    def _text(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self.state == "header":
            self.header += text
            return []
        if self.state == "body":
            return _pieces("content" if self.kind == "raw" else self.kind, text)
        return _pieces("content", text)

    def _marker(self, marker: str) -> list[Piece]:
        if self.state == "header":
            if marker != "<|message|>":
                self.header += marker
                return []
            channel, recipient = harmony_header(self.header)
            self.kind = ("reasoning" if channel == "analysis" and recipient is None
                         else "content" if channel == "final" and recipient is None else "raw")
            out = _pieces("content", self.header + marker) if self.kind == "raw" else []
            self.header, self.state = "", "body"
            return out
        if self.state == "body":
            if marker in _HARMONY_CLOSE or marker == "<|start|>":
                out = _pieces("content", marker) if self.kind == "raw" and marker in _HARMONY_CLOSE else []
                self.state = "top"
                if marker == "<|start|>":
                    self.state, self.header = "header", marker
                return out
            return self._text(marker)  # a marker inside a body: its text
        if marker in _HARMONY_OPEN:
            self.state, self.header = "header", marker
            return []
        return []  # a stray closing marker between messages


@register_reasoning_parser("openai_gptoss")
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels (``HarmonySplitter``): ``<|channel|>analysis<|message|>...<|end|>`` is reasoning,
    ``<|channel|>final<|message|>...`` content; tool calls and other messages pass to the content framing included
    (the ``openai`` tool parser reads them). The markers are special tokens: ``special_tokens`` asks the server to
    keep them in the text (``skip_special_tokens`` false unless the request sets it). ``markers``: the analysis
    message's opening and its ``<|end|>`` (what a thinking budget forces).

    It reads the text, streamed or whole, the same way for every API; the prompts are rendered by ``openai-harmony``
    (``kvserve.engine.harmony_render``). The server picks this parser for a harmony model when none is named."""

    markers = ("<|channel|>analysis<|message|>", "<|end|>")
    special_tokens = True

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        s = HarmonySplitter()
        pieces = s.feed(text) + s.finish()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return reasoning or None, content or None

    def streamer(self) -> ReasoningStreamer:
        return _HarmonyStreamer()


class _HarmonyStreamer(ReasoningStreamer):
    def __init__(self):
        self.splitter = HarmonySplitter()

    def feed(self, delta: str) -> list[Piece]:
        return self.splitter.feed(delta)

    def finish(self) -> list[Piece]:
        return self.splitter.finish()
