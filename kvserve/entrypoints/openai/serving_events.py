"""The base of the APIs rendered from the event model (``kvserve.entrypoints.events``): ``/v1/responses`` and
Anthropic's ``/v1/messages``. ``EventServing`` turns a conversation (chat messages as dicts), a tool mode
(``serving_chat.ToolChoice``), an output constraint and sampling fields into one engine request, and its outputs
into events (``events``), through the reasoning parser (``--reasoning-parser``) and the tool handling once; each
API renders the events, streamed or folded.
"""

from __future__ import annotations

from typing import Optional

from kvserve.engine.protocol import EngineDeadError, EngineShutdownError, ParamError
from kvserve.entrypoints.events import ChoiceEvents
from kvserve.entrypoints.openai.serving_engine import (ClientDisconnected, OpenAIError, OpenAIServing,
                                                       PreparedPrompt, engine_error, run_unless_disconnected)
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams


class EventServing(OpenAIServing):
    """``OpenAIServing`` plus the event pipeline (arguments: ``OpenAIServing``'s; ``options.reasoning_parser``
    splits reasoning from the answer, ``options.thinking_token_budget`` is the default budget)."""

    async def prepare(self, messages: list, tools, structured: Optional[StructuredOutputsParams], sampling: dict,
                      max_tokens: Optional[int], names: dict,
                      chat_template_kwargs: Optional[dict] = None) -> tuple[PreparedPrompt, SamplingParams]:
        """The prompt and the ``SamplingParams`` of one request.

        Args:
            messages: chat messages (dicts, OpenAI's chat shape: ``chat_utils.conversation_from_messages``).
            tools: a ``serving_chat.ToolChoice``; its schema (``tool_choice`` required / named) is the constraint.
            structured: the API's own output constraint (a JSON schema), or ``None``; not with a forced tool.
            sampling: ``SamplingParams`` fields (``temperature``, ``stop``, ``thinking_token_budget``, ...; ``None``
                values left out). Without a budget (and without a constraint) the server's
                ``--thinking-token-budget`` applies; the budget forces the reasoning parser's end marker.
            max_tokens: the request's output bound, or ``None`` (what is left of ``max_model_len``).
            names: the API's spelling of engine fields for error ``param``s: ``messages`` (the prompt),
                ``max_tokens``, ``structured``, any sampling field (``stop`` -> ``stop_sequences``), and a template
                variable the prompt's rendering refuses (``reasoning_effort`` -> ``reasoning.effort``).
            chat_template_kwargs: variables for the chat template (``enable_thinking``, ``reasoning_effort``).

        Raises:
            OpenAIError: 400 naming the API's field (bad messages or values, a prompt that does not fit, a
                constraint that does not compile).
        """
        if structured is not None and tools.schema is not None:
            raise OpenAIError(f"{names['structured']}: cannot be combined with a forced tool_choice",
                              param=names["structured"])
        so = None
        try:
            so = structured if structured is not None else tools.constraint()
            if so is not None:
                await self.llm.check_structured_outputs(so)
        except ParamError as e:
            label = names["structured"] if structured is not None else "tools"
            raise OpenAIError(e.with_prefix(f"structured_outputs.{so.kind if so else 'json'}", label).message,
                              param=label) from None
        try:
            pp = await self.chat_prompt(messages, tools=tools.prompt_tools, chat_template_kwargs=chat_template_kwargs)
        except OpenAIError as e:  # a field the chat API spells otherwise: this API's name, in the message too
            own = names.get(e.param)
            if own and own != e.param:
                if e.message.startswith(e.param):
                    e.message = own + e.message[len(e.param):]
                e.param = own
            raise
        max_tokens = self.check_length(len(pp.token_ids), max_tokens, names["messages"], names["max_tokens"])
        kw = {k: v for k, v in sampling.items() if v is not None}
        try:
            budget = kw.get("thinking_token_budget")
            if budget is None and so is None:
                budget = self.options.thinking_token_budget
            if budget is not None:
                kw["thinking_token_budget"] = budget
                markers, is_open = self.budget_facts(self.reasoning_parser(pp.text, chat_template_kwargs, tools, so))
                kw.update({k: v for k, v in (("reasoning_markers", markers), ("reasoning_open", is_open))
                           if v is not None})
            sp = SamplingParams(max_tokens=max_tokens, **kw)
        except ParamError as e:
            name = e.field.split("[", 1)[0]
            param = names.get(name, name)
            raise OpenAIError(e.renamed(param + e.field[len(name):]).message, param=param) from None
        sp.structured_outputs = so
        return pp, sp

    async def open(self, pp: PreparedPrompt, sp: SamplingParams, request_id: str, arrival: float, tools,
                   names: dict, priority: int = 0, chat_template_kwargs: Optional[dict] = None) -> "EventStream":
        """Queue the request (refused now, before any answer is sent, if the engine refuses it) and return its
        ``EventStream``; the caller aborts it when it stops early. Its reasoning parser sees the prompt's text and
        ``chat_template_kwargs`` (``OpenAIServing.reasoning_parser``: where the output starts).

        Raises:
            OpenAIError: 400 for a request the engine refuses (nothing queued), 503 / 500 for a shutdown / dead
                engine (also raised by the iterator mid-stream).
        """
        try:
            stream = await self.llm.add_request(pp.token_ids, sp, request_id, arrival, priority=priority)
        except ParamError as e:
            name = e.field.split("[", 1)[0].split(".", 1)[0]
            raise OpenAIError(e.message, param=names.get(name, names["messages"])) from None
        except ValueError as e:
            raise OpenAIError(str(e), param=names["messages"]) from None
        except (EngineShutdownError, EngineDeadError) as e:
            raise engine_error(e) from None
        reasoning = self.reasoning_parser(pp.text, chat_template_kwargs, tools, sp.structured_outputs)
        return EventStream(stream, ChoiceEvents(0, tools, reasoning))

    async def collect(self, events: "EventStream", receive) -> Optional[tuple[list, object]]:
        """All the events of an ``open``ed request and its final ``RequestOutput``; ``None`` if the client
        disconnected first (the request is aborted). Raises as ``open``'s iterator."""
        async def run():
            out, final = [], None
            async for evs, o in events:
                out += evs
                final = o
            return out, final

        try:
            return await run_unless_disconnected(run(), receive, [events])
        except ClientDisconnected:
            return None


class EventStream:
    """One request's events: an async iterator of ``(events, RequestOutput)`` per engine output; ``abort()``
    (synchronous, idempotent) ends the request and frees its blocks. The first output's events begin with the tool
    mode's head. Iteration raises ``OpenAIError`` (503 / 500) if the engine shuts down or fails."""

    def __init__(self, stream, choice: ChoiceEvents):
        self.stream = stream
        self.choice = choice
        self._head = choice.head()

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> tuple[list, object]:
        try:
            out = await self.stream.__anext__()
        except (EngineShutdownError, EngineDeadError) as e:
            raise engine_error(e) from None
        c = out.outputs[0]
        events = self._head + self.choice.feed(c.delta_text, c.finish_reason, c.stop_reason)
        self._head = []
        return events, out

    def abort(self) -> None:
        self.stream.abort()
