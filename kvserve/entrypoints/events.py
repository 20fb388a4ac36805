"""One event model of a streamed answer, under every API that renders one (Responses, Anthropic Messages; see
docs/server.md): per choice, the engine's text deltas go through the reasoning parser and the tool-call handling
once (``ChoiceEvents``) and come out as events:

    ReasoningDelta(text) | TextDelta(text) | ToolCallStart(index, id, name) | ToolCallArgsDelta(index, arguments)
    | Finish(finish_reason, stop_reason)

An API's streamed answer renders each event as it comes; its non-streamed answer is the fold of the same events
(``fold``, or the API's own renderer run to the end), so streamed and non-streamed answers are equal by
construction. A non-streamed choice is fed as one delta (its whole text); the parsers and tool streamers give the
same pieces for any cut of a text into deltas (``tests/entrypoints/test_events.py`` checks every cut point).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass(frozen=True)
class TextDelta:
    """Answer text (``content``)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (a thinking model's, split off by the reasoning parser)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: ``index`` (0, 1, ... within the choice), its ``id`` and function ``name``."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A piece of call ``index``'s arguments (JSON text; the pieces concatenate to the whole)."""

    index: int
    arguments: str


@dataclass(frozen=True)
class Finish:
    """The choice ended: ``finish_reason`` ``stop`` / ``length`` / ``tool_calls`` / ``abort``; ``stop_reason`` the
    stop string or stop token that ended it, else ``None``."""

    finish_reason: str
    stop_reason: Any = None


Event = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, Finish]


class ChoiceEvents:
    """Turns one choice's text deltas into events.

    Args:
        index: the choice's index (the tool handling keeps its state per index).
        tools: the request's tool mode (``serving_chat.ToolChoice``: ``head(index)`` and ``stream(index, delta,
            finished) -> (pieces, called)``, pieces content texts and ``ToolCallDelta``s in order), or ``None`` (all
            text is content).
        reasoning: a ``ReasoningParser`` (``reasoning_parsers``), or ``None`` (no reasoning split).
    """

    def __init__(self, index: int = 0, tools=None, reasoning=None):
        self.index = index
        self.tools = tools
        self.reasoning = reasoning.streamer() if reasoning is not None else None
        self.finished = False

    def head(self) -> list[Event]:
        """The events before any text: a named (forced) function's call opens here."""
        if self.tools is None:
            return []
        return _tool_events(self.tools.head(self.index))

    def feed(self, delta: str, finish_reason: Optional[str] = None, stop_reason: Any = None) -> list[Event]:
        """The events of the next text ``delta``; with ``finish_reason`` the choice ends here (held-back text is
        released, and ``Finish`` is the last event)."""
        if self.finished:
            return []
        finishing = finish_reason is not None
        pieces = [("content", delta)] if self.reasoning is None else self.reasoning.feed(delta)
        if finishing and self.reasoning is not None:
            pieces += self.reasoning.finish()
        out: list[Event] = []
        content = ""
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(ReasoningDelta(text))
            else:
                content += text
        called = False
        if self.tools is not None:
            pieces, called = self.tools.stream(self.index, content, finishing)
            for piece in pieces:
                out += [TextDelta(piece)] if isinstance(piece, str) else _tool_events([piece])
        elif content:
            out.append(TextDelta(content))
        if finishing:
            self.finished = True
            reason = "tool_calls" if called and finish_reason == "stop" else finish_reason
            out.append(Finish(reason, stop_reason))
        return _merge(out)


def _tool_events(deltas: list) -> list[Event]:
    """``tool_parsers.ToolCallDelta``s (id and name in a call's first piece) -> events."""
    out: list[Event] = []
    for d in deltas:
        if d.id is not None:
            out.append(ToolCallStart(d.index, d.id, d.name))
        if d.arguments:
            out.append(ToolCallArgsDelta(d.index, d.arguments))
    return out


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent text (or reasoning) deltas joined into one."""
    out: list[Event] = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (TextDelta, ReasoningDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


@dataclass
class Answer:
    """The fold of one choice's events: what a non-streamed answer shows.

    Attributes:
        reasoning: the reasoning text, or ``None``; ``text``: the answer text, or ``None``.
        tool_calls: ``[{"id", "name", "arguments"}]`` in order.
        finish_reason, stop_reason: from ``Finish`` (``None`` before it).
        items: the answer's parts in the order they began: ``("reasoning", text)``, ``("text", text)``,
            ``("tool_call", call dict)`` (an API that lists output items, as Responses and Messages do, follows it).
    """

    reasoning: Optional[str] = None
    text: Optional[str] = None
    tool_calls: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    items: list = field(default_factory=list)


def fold(events: list[Event]) -> Answer:
    """The ``Answer`` of ``events`` (any cut into deltas folds to the same answer)."""
    a = Answer()
    calls: dict = {}
    for e in events:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            kind = "text" if isinstance(e, TextDelta) else "reasoning"
            if a.items and a.items[-1][0] == kind:
                a.items[-1] = (kind, a.items[-1][1] + e.text)
            else:
                a.items.append((kind, e.text))
            setattr(a, kind, (getattr(a, kind) or "") + e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
            a.tool_calls.append(calls[e.index])
            a.items.append(("tool_call", calls[e.index]))
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index]["arguments"] += e.arguments
        elif isinstance(e, Finish):
            a.finish_reason, a.stop_reason = e.finish_reason, e.stop_reason
    return a
