"""``POST /v1/chat/completions`` (vLLM's ``serving_chat``): the chat template over ``messages`` (with the request's
``chat_template_kwargs``), ``n`` samples, chat logprobs, tools (``ToolChoice``: "none", "auto" parsed from the
model's own format by the server's tool parser, "required" or a named function enforced by a grammar), reasoning
(``--reasoning-parser``: ``reasoning_content`` and ``reasoning``) and structured outputs, streaming or not. Each
choice's text goes through ``events.ChoiceEvents`` (the event model every API renders: the reasoning parser, then
the tool mode); the non-streamed message is the fold of the events of its whole text, so streamed and non-streamed
answers agree.
"""

from __future__ import annotations

import time
from typing import Optional

from kvserve.entrypoints.events import (ChoiceEvents, Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta,
                                        ToolCallStart, fold)
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai import request_fields
from kvserve.entrypoints.openai import tool_parsers as tp
from kvserve.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, include_usage, new_id, now_s, sse,
                                                       usage_of)
from kvserve.structured import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    """The chat-completions endpoint (arguments: ``OpenAIServing``)."""

    async def create_chat_completion(self, req: p.ChatCompletionRequest, receive):
        """``POST /v1/chat/completions``; returns like ``create_completion`` (``ChatCompletionResponse``)."""
        arrival = now_s()
        self.check_model(req.model)
        self.check_bounds(req)
        self.check_unsupported(req)
        tools = ToolChoice.create([t.model_dump(exclude_none=True) for t in req.tools or []],
                                  _choice_dict(req.tool_choice), req.parallel_tool_calls, **self.tool_parser_args())
        structured = await self.structured_outputs(req, tools)
        template_kwargs = request_fields.template_kwargs(req)
        pp = await self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                    tools.prompt_tools, template_kwargs, req.truncate_prompt_tokens)
        reasoning = self.reasoning_parser(pp.text, template_kwargs, tools, structured)
        include_reasoning = req.include_reasoning is not False
        use_mct = req.max_completion_tokens is not None
        requested = req.max_completion_tokens if use_mct else req.max_tokens
        max_tokens = self.check_length(len(pp.token_ids), requested, "messages",
                                       "max_completion_tokens" if use_mct else "max_tokens")
        top_n = req.top_logprobs or 0
        plp = self.engine_prompt_logprobs(req)
        params = [self.sampling_params(req, max_tokens, top_n if req.logprobs else None, plp, structured, reasoning,
                                       getattr(tools.parser, "special_tokens", False))]
        rid, created = new_id("chatcmpl"), int(time.time())
        streams = await self.start(req, [pp], params, rid, arrival)

        if not req.stream:
            finals = await self._collect(streams, receive)
            if finals is None:
                return None
            choices = []
            for c in finals[0].outputs:
                lp = self.chat_logprobs(c.token_ids, c.logprobs, top_n) if req.logprobs else None
                choice = ChoiceEvents(c.index, tools, reasoning)  # the events of the whole text, folded
                answer = fold(choice.head() + choice.feed(c.text, c.finish_reason, c.stop_reason))
                message = p.ChatResponseMessage(content=answer.text)
                if answer.reasoning is not None and include_reasoning:
                    message.reasoning_content = message.reasoning = answer.reasoning
                if answer.tool_calls:
                    message.tool_calls = [p.ToolCall(id=t["id"], function=p.FunctionCall(name=t["name"],
                                                                                        arguments=t["arguments"]))
                                          for t in answer.tool_calls]
                choices.append(p.ChatChoice(index=c.index, message=message, logprobs=lp,
                                            finish_reason=answer.finish_reason))
            extra = {}
            if plp is not None:
                extra["prompt_logprobs"] = self.vllm_prompt_logprobs(pp.token_ids, finals[0], plp, plp)
            return p.ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                            usage=usage_of([pp], finals), **extra)

        usage_null = {"usage": None} if include_usage(req) else {}

        def make(choices, usage=None) -> str:
            extra = {"usage": usage} if usage is not None else usage_null
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, **extra))

        choices = {j: ChoiceEvents(j, tools, reasoning) for j in range(params[0].n)}

        def chunk(i: int, c, first: bool) -> str:
            lp = None
            if req.logprobs and c.delta_token_ids:
                entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]
                lp = self.chat_logprobs(c.delta_token_ids, entries, top_n)
            events = choices[c.index].feed(c.delta_text, c.finish_reason, c.stop_reason)
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta)) if include_reasoning else ""
            delta = p.DeltaMessage(content=text) if text else p.DeltaMessage()
            if thought:
                delta.reasoning_content = delta.reasoning = thought
            calls = _delta_tool_calls(events)
            if calls:
                delta.tool_calls = calls
            finish = next((e.finish_reason for e in events if isinstance(e, Finish)), None)
            return make([p.ChatStreamChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish)])

        def head_chunk(j: int) -> str:
            delta = p.DeltaMessage(role="assistant", content="")
            opening = _delta_tool_calls(choices[j].head())
            if opening:
                delta.tool_calls = opening
            return make([p.ChatStreamChoice(index=j, delta=delta)])

        head = [head_chunk(j) for j in range(params[0].n)]
        usage_chunk = (lambda finals: make([], usage_of([pp], finals))) if include_usage(req) else None
        return self._stream(streams, head, chunk, usage_chunk, always_first=False, with_logprobs=bool(req.logprobs))

    def chat_logprobs(self, token_ids: list, entries: list, top_n: int) -> p.ChatLogprobs:
        """Chat logprobs for ``token_ids`` with engine entries ``{token_id: logprob}``, ``top_n`` alternatives;
        ``bytes`` are each token's raw bytes (``TokenVocab.token_bytes``)."""
        content = []
        for t, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(p.ChatTokenLogprob(
                **self._top(t, entry[t]), top_logprobs=[p.TopLogprob(**self._top(k, v)) for k, v in top]))
        return p.ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> dict:
        return {"token": self.vocab.token_name(token_id), "logprob": logprob,
                "bytes": list(self.vocab.token_bytes(token_id))}


def _choice_dict(choice):
    """A chat request's ``tool_choice`` as ``ToolChoice.create`` takes it (a named one as a dict)."""
    return choice.model_dump() if isinstance(choice, p.NamedToolChoice) else choice


def _delta_tool_calls(events: list) -> list:
    """The tool-call events of a chunk -> OpenAI ``delta.tool_calls``: a call's first piece has ``id``, ``type``
    and ``function.name`` (and the arguments that came with it, ``""`` if none yet); later pieces only
    ``function.arguments``. (A choice cut by ``max_tokens`` keeps ``finish_reason`` "length": ``ChoiceEvents``.)"""
    out, started = [], {}
    for e in events:
        if isinstance(e, ToolCallStart):
            call = p.DeltaToolCall(index=e.index, id=e.id, type="function",
                                   function=p.DeltaFunctionCall(name=e.name, arguments=""))
            started[e.index] = call
            out.append(call)
        elif isinstance(e, ToolCallArgsDelta):
            if e.index in started:
                started[e.index].function.arguments += e.arguments
            else:
                out.append(p.DeltaToolCall(index=e.index, function=p.DeltaFunctionCall(arguments=e.arguments)))
    return out


def auto_tool_needs(auto_enabled: bool, parser: Optional[str]) -> str:
    """What the server must be started with for "auto" tool calls: ``--enable-auto-tool-choice`` (enough when
    the chat template implies a parser, ``parser``) and, when no parser is known, ``--tool-call-parser NAME``."""
    if parser is None:
        flags = "--tool-call-parser NAME" if auto_enabled else "--enable-auto-tool-choice and --tool-call-parser NAME"
        return f"the server started with {flags} (this chat template implies no tool-call parser)"
    return (f"the server started with --enable-auto-tool-choice (the tool-call parser is {parser!r}, from "
            f"--tool-call-parser or the chat template)")


class ToolChoice:
    """A chat request's tool mode: ``choice`` "none" (tools left out of the prompt), "auto" (the model's own
    format, parsed by a ``ToolParser``), "required" or a named function (enforced by a grammar: in the tool
    parser's own format when the server names one, ``--tool-call-parser`` (``ToolParser.choice_constraint``), the
    calls then read back by that parser; else the JSON of ``schema``).

    Attributes:
        tools: the OpenAI tools as dicts; ``prompt_tools``: those the chat template gets.
        choice: "none", "auto", "required" or ``{"type": "function", "function": {"name"}}``.
        schema: the JSON schema of "required" / a named choice (``tp.tool_choice_schema``), else ``None``.
        forced: the ``StructuredOutputsParams`` fields that enforce it in the parser's format
            (``ToolParser.choice_constraint``), else ``None``.
        parser: the ``ToolParser`` that reads the output ("auto", or a forced choice with ``forced``), else
            ``None``.
    """

    def __init__(self, tools: list, choice, schema: Optional[dict], parser: str = "hermes",
                 forced: Optional[dict] = None):
        self.tools, self.choice, self.schema, self.forced = tools, choice, schema, forced
        self.prompt_tools = tools if choice != "none" else None
        self.parser = tp.get_tool_parser(parser) if choice == "auto" or forced is not None else None
        self._streams: dict = {}

    @classmethod
    def create(cls, tools: Optional[list], choice, parallel_tool_calls: Optional[bool] = None,
               param: str = "tool_choice", parser: Optional[str] = "hermes",
               auto_enabled: bool = True, forced_format: Optional[str] = None,
               alternatives: str = 'tool_choice "required", "none" or a named function') -> "ToolChoice":
        """From OpenAI ``tools`` (dicts) and a ``tool_choice`` (``None``: "auto" with tools, else "none"; a named
        one as a dict), as every API maps its own tool fields to them. ``parser``: the tool-call format "auto"
        reads (``--tool-call-parser`` or the chat template's); ``auto_enabled``: ``--enable-auto-tool-choice``;
        ``forced_format``: the parser whose format "required" / named choices are written in (the server's
        explicit ``--tool-call-parser``), ``None``: the JSON path; ``alternatives``: the API's spelling of the
        choices that work without ``--enable-auto-tool-choice``, suggested by its 400.

        Raises:
            OpenAIError: (``param``) a choice other than "none" without tools, or naming an unknown function;
                "auto" (the default with tools) without ``--enable-auto-tool-choice`` or without a tool parser
                (vLLM's rule).
        """
        tools = tools or []
        choice = choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise OpenAIError(f"tool_choice {choice!r} needs tools", param=param)
        if choice == "auto" and (not auto_enabled or parser is None):
            raise OpenAIError(f'"auto" tool choice (the default with tools) needs '
                              f'{auto_tool_needs(auto_enabled, parser)}; or send {alternatives}', param=param)
        try:
            schema = tp.tool_choice_schema(tools, choice, parallel_tool_calls)
            forced = (tp.get_tool_parser(forced_format).choice_constraint(tools, choice, parallel_tool_calls)
                      if forced_format is not None and schema is not None else None)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None
        if forced is not None:
            return cls(tools, choice, schema, forced_format, forced)
        return cls(tools, choice, schema, parser or "hermes")

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The output constraint of a forced choice (``forced``, else ``schema`` as JSON), ``None`` otherwise.

        Raises:
            ParamError: (``structured_outputs.json``) a tool's ``parameters`` the grammar cannot enforce (checked
                as JSON either way, so the 400 is the same).
        """
        if self.schema is None:
            return None
        so = StructuredOutputsParams(json=self.schema)
        return so if self.forced is None else StructuredOutputsParams(**self.forced)

    def head(self, index: int) -> list:
        """The ``tp.ToolCallDelta``s for choice ``index``'s first (role) chunk: a named function's call opens
        there (id, name, ``arguments: ""``), as in OpenAI's stream (the JSON path; in a parser's format the call
        opens when the parser reads it)."""
        if self.schema is None or self.forced is not None:
            return []
        return self._streams.setdefault(index, tp.ForcedToolStreamer(self.choice)).head()

    def stream(self, index: int, delta: str, finished: bool) -> tuple[list, bool]:
        """``(pieces, called)`` for a streamed choice's new text ``delta``: the content texts and
        ``tp.ToolCallDelta``s to send now, in order, and whether the choice has made a call so far. Forced calls
        stream as they are generated (``tp.ForcedToolStreamer``); "auto" streams content and calls as the text
        arrives (``tp.AutoToolStreamer``: a call opens once its name and the start of its arguments are read, then
        its arguments go out as fragments). Any cut of a text into deltas gives pieces that add up to the same
        answer (a non-streamed answer is the whole text fed at once: ``events.ChoiceEvents``)."""
        if self.schema is not None and self.forced is None:
            streamer = self._streams.setdefault(index, tp.ForcedToolStreamer(self.choice))
            deltas = streamer.feed(delta)
            return deltas, bool(streamer.calls)
        if self.parser is None:
            return [delta] if delta else [], False
        streamer = self._streams.setdefault(index, tp.AutoToolStreamer(self.parser))
        pieces = streamer.feed(delta, finished)
        return pieces, streamer.called
