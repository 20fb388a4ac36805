"""``POST /v1/chat/completions`` (vLLM's ``serving_chat``): the chat template over ``messages`` (with the request's
``chat_template_kwargs``), ``n`` samples, chat logprobs, tools (``ToolChoice``: "none", "auto" parsed from the
model's own format by the server's tool parser, "required" or a named function enforced by a grammar), reasoning
(``--reasoning-parser``; ``chat_output.ChatOutput`` splits reasoning, content and calls) and structured outputs,
streaming or not.
"""

from __future__ import annotations

import time
from typing import Optional

from kvserve.entrypoints.chat_utils import NoChatTemplateError, chat_template_for
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai import request_fields
from kvserve.entrypoints.openai import tool_parsers as tp
from kvserve.entrypoints.openai.chat_output import ChatOutput
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from kvserve.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, include_usage, new_id, now_s, sse,
                                                       usage_of)


class OpenAIServingChat(OpenAIServing):
    """The chat-completions endpoint (arguments: ``OpenAIServing``). ``tool_parser``: the tool-call format of
    "auto" (``ServingOptions.resolve_tool_parser``: ``--tool-call-parser`` or the chat template's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        try:
            template = chat_template_for(self.tokenizer, self.llm.engine.chat_template, tools=[{}])
        except NoChatTemplateError:
            template = None
        self.tool_parser = self.options.resolve_tool_parser(template)

    def reasoning_parser(self, prompt: str, req: p.ChatCompletionRequest, tools: "ToolChoice",
                         structured) -> Optional[ReasoningParser]:
        """The request's reasoning parser (``--reasoning-parser``), or ``None`` (none configured, or a forced tool
        call: the output is the call). Under a grammar (``structured``) the output starts in the content unless the
        grammar writes the start marker first (``get_reasoning_parser``'s ``constrained``)."""
        name = self.options.reasoning_parser
        if name is None or tools.schema is not None:
            return None
        return get_reasoning_parser(name, prompt, req.chat_template_kwargs, constrained=structured is not None)

    async def create_chat_completion(self, req: p.ChatCompletionRequest, receive):
        """``POST /v1/chat/completions``; returns like ``create_completion`` (``ChatCompletionResponse``)."""
        arrival = now_s()
        self.check_model(req.model)
        self.check_bounds(req)
        self.check_unsupported(req)
        tools = ToolChoice.of(req, self.tool_parser, self.options.enable_auto_tool_choice)
        structured = await self.structured_outputs(req, tools.schema)
        pp = await self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                    tools.prompt_tools, request_fields.template_kwargs(req), req.truncate_prompt_tokens)
        output = ChatOutput(tools, self.reasoning_parser(pp.text, req, tools, structured), req.include_reasoning is not False)
        use_mct = req.max_completion_tokens is not None
        requested = req.max_completion_tokens if use_mct else req.max_tokens
        max_tokens = self.check_length(len(pp.token_ids), requested, "messages",
                                       "max_completion_tokens" if use_mct else "max_tokens")
        top_n = req.top_logprobs or 0
        plp = self.engine_prompt_logprobs(req)
        params = [self.sampling_params(req, max_tokens, top_n if req.logprobs else None, plp, structured)]
        rid, created = new_id("chatcmpl"), int(time.time())
        streams = await self.start(req, [pp], params, rid, arrival)

        if not req.stream:
            finals = await self._collect(streams, receive)
            if finals is None:
                return None
            choices = []
            for c in finals[0].outputs:
                lp = self.chat_logprobs(c.token_ids, c.logprobs, top_n) if req.logprobs else None
                reasoning, content, calls = output.extract(c.text)
                message = p.ChatResponseMessage(content=content)
                if reasoning is not None:
                    message.reasoning_content = message.reasoning = reasoning
                if calls:
                    message.tool_calls = [p.ToolCall(id=t.id, function=p.FunctionCall(name=t.name,
                                                                                     arguments=t.arguments))
                                          for t in calls]
                choices.append(p.ChatChoice(index=c.index, message=message, logprobs=lp,
                                            finish_reason=_tool_finish(c.finish_reason, bool(calls))))
            extra = {}
            if plp is not None:
                extra["prompt_logprobs"] = self.vllm_prompt_logprobs(pp.token_ids, finals[0], plp, plp)
            return p.ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                            usage=usage_of([pp], finals), **extra)

        usage_null = {"usage": None} if include_usage(req) else {}

        def make(choices, usage=None) -> str:
            extra = {"usage": usage} if usage is not None else usage_null
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, **extra))

        def chunk(i: int, c, first: bool) -> str:
            lp = None
            if req.logprobs and c.delta_token_ids:
                entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]
                lp = self.chat_logprobs(c.delta_token_ids, entries, top_n)
            reasoning, text, deltas, called = output.stream(c.index, c.delta_text, c.finish_reason is not None)
            delta = p.DeltaMessage(content=text) if text else p.DeltaMessage()
            if reasoning:
                delta.reasoning_content = delta.reasoning = reasoning
            if deltas:
                delta.tool_calls = _delta_tool_calls(deltas)
            return make([p.ChatStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                            finish_reason=_tool_finish(c.finish_reason, called))])

        def head_chunk(j: int) -> str:
            delta = p.DeltaMessage(role="assistant", content="")
            opening = tools.head(j)
            if opening:
                delta.tool_calls = _delta_tool_calls(opening)
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


def _tool_finish(finish_reason: Optional[str], called: bool) -> Optional[str]:
    """``"tool_calls"`` for a choice that ended on its own (``"stop"``) with tool calls; a choice cut by
    ``max_tokens`` stays ``"length"`` (its complete calls are returned all the same: ``tp.forced_calls``)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _delta_tool_calls(deltas: list) -> list:
    """``tp.ToolCallDelta``s -> OpenAI ``delta.tool_calls`` (``id``, ``type`` and ``function.name`` only in a
    call's first piece)."""
    out = []
    for d in deltas:
        fn = p.DeltaFunctionCall(arguments=d.arguments)
        if d.name is not None:
            fn.name = d.name
        call = p.DeltaToolCall(index=d.index, function=fn)
        if d.id is not None:
            call.id, call.type = d.id, "function"
        out.append(call)
    return out


class ToolChoice:
    """A chat request's tool mode: ``choice`` "none" (tools left out of the prompt), "auto" (the model's own
    format, parsed by a ``ToolParser``), "required" or a named function (enforced by ``schema``).

    Attributes:
        tools: the OpenAI tools as dicts; ``prompt_tools``: those the chat template gets.
        choice: "none", "auto", "required" or ``{"type": "function", "function": {"name"}}``.
        schema: the JSON schema that enforces "required" / a named choice, else ``None``.
    """

    def __init__(self, tools: list, choice, schema: Optional[dict], parser: str = "hermes"):
        self.tools, self.choice, self.schema = tools, choice, schema
        self.prompt_tools = tools if choice != "none" else None
        self.parser = tp.get_tool_parser(parser) if choice == "auto" else None
        self._streams: dict = {}

    @classmethod
    def of(cls, req: p.ChatCompletionRequest, parser: Optional[str] = "hermes",
           auto_enabled: bool = True) -> "ToolChoice":
        """``parser``: the tool-call format "auto" reads; ``auto_enabled``: ``--enable-auto-tool-choice``.

        Raises:
            OpenAIError: a ``tool_choice`` without ``tools`` or naming an unknown function; "auto" (the default
                with tools) without ``--enable-auto-tool-choice`` or without a tool parser (vLLM's rule).
        """
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice or ("auto" if tools else "none")
        if isinstance(choice, p.NamedToolChoice):
            choice = choice.model_dump()
        if choice != "none" and not tools:
            raise OpenAIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice == "auto" and (not auto_enabled or parser is None):
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and a tool-call parser '
                              '(--tool-call-parser, or one the chat template implies) to be set; or send '
                              'tool_choice "required", "none" or a named function', param="tool_choice")
        try:
            schema = tp.tool_choice_schema(tools, choice, req.parallel_tool_calls)
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice") from None
        return cls(tools, choice, schema, parser or "hermes")

    def extract(self, text: str) -> tuple[Optional[str], list]:
        """``(content, calls)`` of a finished choice's text (``tp.forced_calls`` for "required" / a named
        function: no content; the parser's split for "auto")."""
        if self.schema is not None:
            return None, tp.forced_calls(text, self.choice)
        if self.parser is not None:
            ex = self.parser.extract(text)
            return ex.content, ex.tool_calls
        return text, []

    def head(self, index: int) -> list:
        """The ``tp.ToolCallDelta``s for choice ``index``'s first (role) chunk: a named function's call opens
        there (id, name, ``arguments: ""``), as in OpenAI's stream."""
        if self.schema is None:
            return []
        return self._streams.setdefault(index, tp.ForcedToolStreamer(self.choice)).head()

    def stream(self, index: int, delta: str, finished: bool) -> tuple[str, list, bool]:
        """``(content, deltas, called)`` for a streamed choice's new text ``delta``: the content and the
        ``tp.ToolCallDelta``s to send now, and whether the choice has made a call so far. Forced calls stream as
        they are generated (``tp.ForcedToolStreamer``); "auto" passes content through until a call may begin and
        sends its calls in the choice's last chunk (``tp.AutoToolStreamer``). The pieces add up to ``extract`` of the
        whole text."""
        if self.schema is not None:
            streamer = self._streams.setdefault(index, tp.ForcedToolStreamer(self.choice))
            deltas = streamer.feed(delta)
            return "", deltas, bool(streamer.calls)
        if self.parser is None:
            return delta, [], False
        streamer = self._streams.setdefault(index, tp.AutoToolStreamer(self.parser))
        out = streamer.feed(delta)
        if not finished:
            return out, [], False
        rest, calls = streamer.finish()
        return out + rest, tp.whole_call_deltas(calls), bool(calls)
