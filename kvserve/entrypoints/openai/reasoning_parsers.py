"""Reasoning parsers, registered by vLLM's names (``--reasoning-parser``): split a thinking model's text into its
reasoning and its answer (``content``).

``ReasoningParser.extract(text) -> (reasoning, content)`` for a whole text; ``streamer()`` returns a
``ReasoningStreamer`` whose ``feed(delta)`` / ``finish()`` give ``(kind, text)`` pieces, kind ``"reasoning"`` or
``"content"``. ``extract`` is the streamer run over the whole text, so the streamed pieces always join to it.

Registered:

- ``deepseek_r1``: ``<think>reasoning</think>content``; the opening tag may be missing (the template wrote it in
  the prompt); without ``</think>`` everything is reasoning (the model was still thinking), as vLLM's parser.
- ``qwen3``: the same tags, but an output that does not open with ``<think>`` is all content (thinking switched
  off: ``chat_template_kwargs: {"enable_thinking": false}``, whose template writes the empty think block in the
  prompt). vLLM's parser also takes ``reasoning</think>content`` with the opening tag in the prompt (Qwen3's
  *Thinking* checkpoints); that case needs the whole text before the first byte of content could go out, so it
  is not taken here.
"""

from __future__ import annotations

from typing import Optional


class ReasoningStreamer:
    """Splits a growing text into reasoning and content pieces; holds back text that may be a partial tag."""

    def __init__(self, start: str, end: str, implicit_open: bool):
        self.start, self.end, self.implicit_open = start, end, implicit_open
        self.mode = "undecided"  # -> "reasoning" -> "content", or straight to "content"
        self.buf = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """The pieces that ``delta`` (the next text) lets out now."""
        self.buf += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """The pieces still held back, at the end of the text."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.mode == "undecided":
            if self.buf.startswith(self.start):
                self.buf, self.mode = self.buf[len(self.start):], "reasoning"
            elif self.start.startswith(self.buf) and not final:
                return out  # may still become the opening tag
            else:
                self.mode = "reasoning" if self.implicit_open else "content"
        if self.mode == "reasoning":
            at = self.buf.find(self.end)
            if at >= 0:
                if at:
                    out.append(("reasoning", self.buf[:at]))
                self.buf, self.mode = self.buf[at + len(self.end):], "content"
            else:
                keep = 0 if final else _partial_suffix(self.buf, self.end)
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if text:
                    out.append(("reasoning", text))
        if self.mode == "content" and self.buf:
            out.append(("content", self.buf))
            self.buf = ""
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """A ``<think>``-style parser: ``start`` / ``end`` tags; ``implicit_open``: text before ``end`` is reasoning
    even without ``start``."""

    start = "<think>"
    end = "</think>"
    implicit_open = True

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self.start, self.end, self.implicit_open)

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """``(reasoning, content)`` of a whole text, each ``None`` when empty."""
        s = self.streamer()
        pieces = s.feed(text) + s.finish()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return reasoning or None, content or None


_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str):
    """Class decorator: make a ``ReasoningParser`` available as ``get_reasoning_parser(name)``."""
    def deco(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls
    return deco


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new parser registered as ``name``.

    Raises:
        ValueError: no parser of that name (the message lists the registered ones).
    """
    if name not in _PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not registered; known: {sorted(_PARSERS)}")
    return _PARSERS[name]()


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_open = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    implicit_open = False
