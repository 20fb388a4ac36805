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
