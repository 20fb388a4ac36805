"""A chat answer's text -> reasoning, content and tool calls, streamed or not, by one rule: the reasoning parser
first (``reasoning_parsers``), then the tool mode on the content (``serving_chat.ToolChoice``). The streamed pieces
add up to the non-streamed answer because each stage's streamer adds up to its own ``extract``.
"""

from __future__ import annotations

from typing import Optional

from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStreamer


class ChatOutput:
    """Splits one chat request's choices.

    Args:
        tools: the request's ``ToolChoice`` (``extract(text)``, ``stream(index, delta, finished)``).
        reasoning: the request's ``ReasoningParser``, or ``None`` (no ``--reasoning-parser``, or an output that a
            grammar constrains from its first token: structured outputs, a forced tool call).
        include_reasoning: vLLM's ``include_reasoning``: false drops the reasoning from the answer.
    """

    def __init__(self, tools, reasoning: Optional[ReasoningParser], include_reasoning: bool = True):
        self.tools, self.reasoning, self.include_reasoning = tools, reasoning, include_reasoning
        self._streamers: dict[int, ReasoningStreamer] = {}

    def extract(self, text: str) -> tuple[Optional[str], Optional[str], list]:
        """``(reasoning, content, calls)`` of a finished choice's ``text``."""
        if self.reasoning is None:
            content, calls = self.tools.extract(text)
            return None, content, calls
        reasoning, content = self.reasoning.extract(text)
        content, calls = self.tools.extract(content) if content is not None else (None, [])
        return (reasoning if self.include_reasoning else None), content, calls

    def stream(self, index: int, delta: str, finished: bool) -> tuple[str, str, list, bool]:
        """``(reasoning, content, tool-call deltas, called)`` to send for choice ``index``'s new text ``delta``
        (``finished``: its last)."""
        if self.reasoning is None:
            content, deltas, called = self.tools.stream(index, delta, finished)
            return "", content, deltas, called
        streamer = self._streamers.setdefault(index, self.reasoning.streamer())
        pieces = streamer.feed(delta) + (streamer.finish() if finished else [])
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        content, deltas, called = self.tools.stream(index, "".join(t for kind, t in pieces if kind == "content"),
                                                    finished)
        return (reasoning if self.include_reasoning else ""), content, deltas, called
