"""What every OpenAI endpoint shares (vLLM's ``serving_engine``): the ``OpenAIServing`` base class (model and
parameter checks, ``SamplingParams`` from a request, prompts into token ids, structured-output grammars, queueing
on the ``EngineClient``, collecting or streaming the outputs), the errors (``OpenAIError``, ``ClientDisconnected``,
``engine_error``), the SSE helpers (``sse``, ``SSE_DONE``, ``merge_streams``) and ``usage_of``.

Every request-level problem becomes an ``OpenAIError`` (HTTP 400 with ``param``) before anything is queued. A client
that goes away has its requests aborted at once (``OutputStream.abort``), streaming or not. A stream is SSE chunks
(``data: {json}``, the last chunk of each choice with ``finish_reason``, an optional usage chunk with empty
``choices``, then ``data: [DONE]``). The endpoints themselves: ``serving_completion``, ``serving_chat``,
``serving_tokenization``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from kvserve.engine.protocol import (EngineClient, EngineDeadError, EngineShutdownError, NoChatTemplateError,
                                     OutputStream, ParamError)
from kvserve.entrypoints.chat_utils import MessageError, conversation_from_messages
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai import request_fields
from kvserve.entrypoints.openai.limits import RequestLimits, longest_token_chars
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from kvserve.entrypoints.openai.serving_options import ServingOptions
from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams
from kvserve.structured import StructuredOutputsParams
from kvserve.validation import check_int


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class PreparedPrompt:
    """One prompt ready for the engine: ``token_ids`` and the ``text`` used by ``echo``."""

    token_ids: list
    text: str


class OpenAIServing:
    """The base of the endpoint classes: what they share over one ``EngineClient``.

    Args:
        llm: the engine client (``AsyncLLM`` or the Ray ingress's ``RayEngineClient``).
        served_model_name: the only model name accepted in requests (``model`` may also be omitted).
        vocab: the tokens' names and bytes in logprobs answers; default the client's ``token_vocab``.
        limits: the request bounds (``limits.RequestLimits``; default: its defaults, ``max_prompt_chars`` derived
            from ``llm.max_model_len``).
        options: the server's parsers (``serving_options.ServingOptions``; default: none).
    """

    def __init__(self, llm: EngineClient, served_model_name: str, vocab=None,
                 limits: Optional[RequestLimits] = None, options: Optional[ServingOptions] = None):
        self.llm = llm
        self.options = options if options is not None else ServingOptions()
        self.limits = limits if limits is not None else RequestLimits().resolve(
            llm.max_model_len, longest_token_chars(llm.tokenizer))
        self.model_name = served_model_name
        self.tokenizer = llm.tokenizer
        self.vocab_size = llm.model_info.vocab_size
        self.vocab = vocab if vocab is not None else llm.token_vocab

    def tool_parser_args(self) -> dict:
        """``serving_chat.ToolChoice.create``'s ``parser``, ``auto_enabled`` and ``forced_format``: the server's
        tool-call format (``--tool-call-parser``, or the chat template's: resolved once by ``build_app``),
        ``--enable-auto-tool-choice``, and the format forced choices are written in (an explicit
        ``--tool-call-parser``, else ``None``: JSON)."""
        return {"parser": self.options.tool_call_parser, "auto_enabled": self.options.enable_auto_tool_choice,
                "forced_format": self.options.forced_tool_format}

    def reasoning_parser(self, prompt: str, chat_template_kwargs: Optional[dict], tools=None,
                         structured=None) -> Optional[ReasoningParser]:
        """A request's reasoning parser (``--reasoning-parser``), or ``None`` (none configured, or a forced tool
        call, ``tools.schema``: the output is the call). ``prompt`` (the rendered template's text) and
        ``chat_template_kwargs`` decide whether the output starts in the reasoning (a template that opened
        ``<think>`` or closed an empty one in the prompt); under a grammar (``structured``) the output starts in
        the content unless the grammar writes the start marker first (``get_reasoning_parser``'s ``constrained``)."""
        name = self.options.reasoning_parser
        if name is None or (tools is not None and tools.schema is not None):
            return None
        return get_reasoning_parser(name, prompt, chat_template_kwargs, constrained=structured is not None)

    def budget_facts(self, reasoning: Optional[ReasoningParser]) -> tuple:
        """``(reasoning_markers, reasoning_open)`` of a thinking budget (``SamplingParams``): the request's parser's
        markers and whether the output starts in its reasoning; without a request parser the server's parser's
        markers and ``None`` (the prompt decides); ``(None, None)`` with no parser at all."""
        if reasoning is not None:
            return reasoning.markers, reasoning.open_at_start
        name = self.options.reasoning_parser
        return (get_reasoning_parser(name).markers if name else None), None

    # ------------------------------------------------------------------------------------------------ checks
    def check_model(self, model: Optional[str]) -> None:
        """Raises ``OpenAIError`` (404 ``not_found_error``, ``model_not_found``: as OpenAI and vLLM answer) unless
        ``model`` is ``None`` or the served name."""
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", status=404, type="not_found_error", code="model_not_found")

    def check_bounds(self, req) -> None:
        """400 for a request over the server's bounds (``RequestLimits.check_request``: stop strings, tools,
        schemas); prompts are bounded where they are read (``completion_prompts``, ``chat_prompt``)."""
        self.limits.check_request(req)

    def check_unsupported(self, req) -> None:
        """400 for every parameter set to something the engine cannot do (never silently ignored)."""
        policy = self.llm.model_info.scheduling_policy
        def bad(param: str, why: str):
            raise OpenAIError(f"{param}: {why}", param=param, code="unsupported_parameter")

        if req.priority and policy != "priority":
            bad("priority", "priority needs the server to run with --scheduling-policy priority")
        if req.stream_options is not None and not req.stream:
            bad("stream_options", "stream_options is only allowed when stream is true")
        if isinstance(req, p.CompletionRequest):
            if req.best_of is not None and req.best_of != (req.n or 1):
                bad("best_of", f"best_of other than n (ranking extra samples) is not supported, got {req.best_of}")
            if req.suffix is not None:
                bad("suffix", "suffix (insertion) is not supported")
            return
        if req.functions:
            bad("functions", "the deprecated functions are not supported; use tools")
        if req.function_call not in (None, "none"):
            bad("function_call", "the deprecated function_call is not supported; use tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            bad("top_logprobs", "top_logprobs needs logprobs=true")

    def sampling_params(self, req, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        structured: Optional[StructuredOutputsParams] = None,
                        reasoning: Optional[ReasoningParser] = None,
                        special_tokens: bool = False) -> SamplingParams:
        """``SamplingParams`` from the request's fields (``None`` = default); ``prompt_logprobs`` for ``echo``;
        ``structured`` the request's grammar (``structured_outputs``: then the server's default thinking budget
        does not apply, and the request's own is a 400); ``reasoning`` the request's reasoning parser
        (``reasoning_parser``): a thinking budget forces its end marker and counts from the first token when the
        parser reads the output as reasoning from there. A reasoning parser with ``special_tokens`` (harmony), or
        ``special_tokens`` (the request's tool parser has it), keeps special tokens in the text unless the request
        sets ``skip_special_tokens``.

        Raises:
            OpenAIError: a value out of range (the message from ``SamplingParams``, ``param`` the field).
        """
        kw = dict(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  structured_outputs=structured)
        for name, default in (("n", 1), ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("min_tokens", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0), ("ignore_eos", False), ("include_stop_str_in_output", False),
                              ("skip_special_tokens", True), ("stop", None), ("seed", None), ("stop_token_ids", [])):
            value = getattr(req, name)
            kw[name] = default if value is None else value
        bad_ids = [t for t in kw["stop_token_ids"] if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise OpenAIError(f"stop_token_ids must be token ids in [0, {self.vocab_size}), got {bad_ids[:5]}",
                              param="stop_token_ids")
        if isinstance(kw["top_k"], int) and kw["top_k"] > self.vocab_size:
            kw["top_k"] = self.vocab_size  # the same distribution: every token kept
        if req.skip_special_tokens is None and (getattr(reasoning, "special_tokens", False) or special_tokens):
            kw["skip_special_tokens"] = False  # the parsers read markers that are special tokens (harmony)
        default_budget = self.options.thinking_token_budget if structured is None else None
        kw.update(request_fields.sampling_fields(req, self.vocab_size, default_budget, *self.budget_facts(reasoning)))
        try:
            return SamplingParams(**kw)
        except ParamError as e:
            raise param_error(e, req) from None

    def engine_prompt_logprobs(self, req, echo_k: Optional[int] = None) -> Optional[int]:
        """The engine's ``prompt_logprobs`` for ``req``: vLLM's ``prompt_logprobs`` field and ``echo_k`` (the
        ``logprobs`` of a completions ``echo``), the larger when both are set (each answer shows its own top k).

        Raises:
            OpenAIError: ``prompt_logprobs`` outside [0, 20], or with ``stream: true`` (vLLM refuses it too: prompt
                logprobs are not streamed).
        """
        k = req.prompt_logprobs
        if k is None:
            return echo_k
        try:
            check_int("prompt_logprobs", k, 0, MAX_LOGPROBS)
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt_logprobs") from None
        if req.stream:
            raise OpenAIError("prompt_logprobs is not available with stream=true (as in vLLM); ask without stream",
                              param="prompt_logprobs", code="unsupported_parameter")
        return k if echo_k is None else max(k, echo_k)

    def check_length(self, n_prompt: int, max_tokens: Optional[int], prompt_param: str, max_param: str) -> int:
        """The request's ``max_tokens`` (default: what is left of ``max_model_len``).

        Raises:
            OpenAIError: the prompt leaves no room, or prompt + ``max_tokens`` exceeds ``max_model_len`` (the
                message begins with the field, ``prompt_param`` or ``max_param``: an Anthropic error has no
                ``param``).
        """
        limit = self.llm.max_model_len
        if n_prompt >= limit:
            raise OpenAIError(f"{prompt_param}: the prompt has {n_prompt} tokens; this model's maximum context "
                              f"length is {limit} tokens, including at least 1 generated token", param=prompt_param,
                              code="context_length_exceeded")
        if max_tokens is None:
            return limit - n_prompt
        if isinstance(max_tokens, int) and max_tokens >= 1 and n_prompt + max_tokens > limit:
            raise OpenAIError(f"{max_param}: this model's maximum context length is {limit} tokens; you requested "
                              f"{n_prompt} prompt + {max_tokens} completion tokens", param=max_param,
                              code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------------------------------------------------------ prompts
    async def completion_prompts(self, prompt, truncate: Optional[int] = None) -> list:
        """Normalize ``prompt`` (str, list of str, token ids, list of token-id lists) into ``PreparedPrompt``s; with
        ``truncate`` (``truncate_prompt_tokens``) each keeps its last ``truncate`` tokens.

        Text is tokenized off the engine's thread (``EngineClient.tokenize``), after its length is checked against
        ``limits.max_prompt_chars``.

        Raises:
            OpenAIError: empty prompt list, an empty prompt, a text over ``max_prompt_chars``, or token ids out of
                range.
        """
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError("prompt must not be an empty list", param="prompt")
        for i, item in enumerate(prompts):
            if isinstance(item, str):
                self.limits.check_prompt_chars(item, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        out = []
        for item in prompts:
            try:
                ids = await self.llm.tokenize(item)
            except ParamError as e:
                raise OpenAIError(str(e), param="prompt") from None
            if truncate is not None:
                ids = request_fields.truncate_prompt(ids, truncate, self.llm.max_model_len)
            text = item if isinstance(item, str) and truncate is None else await self.llm.detokenize(ids)
            out.append(PreparedPrompt(ids, text))
        return out

    async def chat_prompt(self, messages: list, add_generation_prompt: bool = True,
                          continue_final_message: bool = False, tools: Optional[list] = None,
                          chat_template_kwargs: Optional[dict] = None,
                          truncate: Optional[int] = None) -> PreparedPrompt:
        """Apply the chat template to ``messages`` (pydantic messages or plain dicts, validated by
        ``conversation_from_messages``, the rule the offline ``LLM.chat`` uses too) and ``tools``
        (``EngineClient.render_chat``, with ``chat_template_kwargs``: ``request_fields.template_kwargs``);
        ``truncate``: keep the last tokens (``truncate_prompt_tokens``). The template is rendered and its text
        tokenized off the engine's thread; the messages' text and then the rendered text are checked against
        ``limits.max_prompt_chars`` first.

        Raises:
            OpenAIError: no messages, a bad role or content (``param`` names it, e.g. ``messages[0].content``), a
                lone surrogate in a string, text over ``max_prompt_chars``, a conversation the template rejects, or
                no chat template at all (neither the model's nor ``--chat-template``: the message says how to pass one).
        """
        try:
            conversation = conversation_from_messages([m if isinstance(m, dict) else m.model_dump(exclude_unset=True)
                                                       for m in messages])
        except MessageError as e:
            raise OpenAIError(str(e), param=e.param) from None
        self.limits.check_prompt_chars("".join(_texts(conversation)), "messages")
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise OpenAIError("continue_final_message needs the last message to be an assistant message",
                              param="continue_final_message")

        try:
            text = await self.llm.render_chat(conversation, tools, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message,
                                              chat_template_kwargs=chat_template_kwargs)
        except NoChatTemplateError as e:
            raise OpenAIError(str(e)) from None
        except ParamError as e:  # the template's rejection (messages), harmony's (reasoning_effort, messages[i])
            raise OpenAIError(str(e), param=e.field) from None
        self.limits.check_prompt_chars(text, "messages")
        try:  # the same tokenization as the offline LLM.chat: the template's text carries its special tokens
            ids = await self.llm.tokenize(text, False)
        except ParamError as e:
            raise OpenAIError(f"messages: {e}", param="messages") from None
        return PreparedPrompt(request_fields.truncate_prompt(ids, truncate, self.llm.max_model_len), text)

    # ------------------------------------------------------------------------------------------------ generation
    async def start(self, req, prompts: list, params: list, request_id: str, arrival: float) -> list:
        """Queue every prompt of ``req`` (ids ``{request_id}-{i}``); all or nothing.

        Raises:
            OpenAIError: 400 for a request the engine rejects, 503 while shutting down, 500 if the engine died.
        """
        streams = []
        try:
            for i, (pp, sp) in enumerate(zip(prompts, params)):
                streams.append(await self.llm.add_request(pp.token_ids, sp, f"{request_id}-{i}", arrival,
                                                          priority=req.priority or 0))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ValueError):
                default = "prompt" if isinstance(req, p.CompletionRequest) else "messages"
                err = param_error(e, req) if isinstance(e, ParamError) else OpenAIError(str(e))
                raise OpenAIError(str(err), param=err.param or default) from None
            if isinstance(e, (EngineShutdownError, EngineDeadError)):
                raise engine_error(e) from None
            raise
        return streams

    def vllm_prompt_logprobs(self, token_ids: list, out, k: int, k_engine: int) -> list:
        """vLLM's ``prompt_logprobs`` answer field for a prompt's ``token_ids`` from the engine's ``RequestOutput``
        ``out`` (``prompt_logprobs`` computed with top ``k_engine`` >= ``k``, and ``prompt_logprob_ranks``):
        ``None`` for the first token, then per token ``{token_id: PromptLogprob}``: the prompt token first with
        its rank over the whole vocabulary, then the top ``k`` with ranks 1..k; ``decoded_token`` is
        ``TokenVocab.token_name`` (raw bytes, never a lone decode)."""
        def entry(t: int, logprob: float, rank: Optional[int]) -> p.PromptLogprob:
            return p.PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.vocab.token_name(t))

        answer: list = [None]
        for t, e, target_rank in zip(token_ids[1:], out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:]):
            top = list(itertools.islice(e, k_engine))  # the engine's top ids in rank order (the target may follow)
            d = {t: entry(t, e[t], target_rank)}
            for rank, tid in enumerate(top[:k], 1):
                d.setdefault(tid, entry(tid, e[tid], rank))
            answer.append(d)
        return answer

    async def structured_outputs(self, req, tools=None) -> Optional[StructuredOutputsParams]:
        """The request's grammar: ``response_format`` (json_object / json_schema), one of vLLM's ``guided_*``
        fields, or the tool-call grammar of ``tool_choice`` "required" / a named function (``tools``, a
        ``serving_chat.ToolChoice``: ``constraint()``); compiled now (cached per engine), so a bad one is a 400 before
        anything is queued.

        Raises:
            OpenAIError: more than one of them; a schema that is not an object or uses an unsupported feature (the
                message names it); a regex / grammar that does not compile (``param`` the field).
        """
        given = [n for n in ("response_format", "structured_outputs", *GUIDED_FIELDS) if getattr(req, n) is not None]
        if req.response_format is not None and req.response_format.type == "text":
            given.remove("response_format")
        if tools is not None and tools.schema is not None:
            given.append("tool_choice")
        if len(given) > 1:
            raise OpenAIError(f"{given[1]}: cannot be combined with {given[0]} (one output constraint per request)",
                              param=given[1])
        if not given:
            return None
        name = given[0]
        so = None
        label = {"response_format": "response_format.json_schema.schema", "tool_choice": "tools"}.get(name, name)
        try:
            if name == "response_format":
                rf = req.response_format
                if rf.type == "json_object":
                    so = StructuredOutputsParams(json_object=True)
                elif rf.json_schema is None or rf.json_schema.json_schema is None:
                    raise ParamError.of(label, " is required with response_format type 'json_schema'")
                else:
                    so = StructuredOutputsParams(json=rf.json_schema.json_schema)
            elif name == "tool_choice":
                so = tools.constraint()
            elif name == "structured_outputs":
                so = StructuredOutputsParams(**req.structured_outputs.model_dump(exclude_none=True, by_alias=True))
            else:
                so = StructuredOutputsParams(**{name.removeprefix("guided_"): getattr(req, name)})
            await self.llm.check_structured_outputs(so)
        except ParamError as e:
            if name == "response_format":
                kind = "json_object" if req.response_format.type == "json_object" else "json"
            else:
                kind = (so.kind if so is not None else "json") if name == "tool_choice" else name.removeprefix(
                    "guided_")
            e = e.with_prefix(f"structured_outputs.{kind}", label)
            raise OpenAIError(e.message, param="tools" if name == "tool_choice" else name) from None
        return so

    async def _collect(self, streams: list, receive) -> Optional[list]:
        """The final output of every stream, in order; ``None`` if the client disconnected first."""
        async def collect():
            finals = [None] * len(streams)
            async for i, out in merge_streams(streams):
                if out.finished:
                    finals[i] = out
            return finals

        try:
            return await run_unless_disconnected(collect(), receive, streams)
        except ClientDisconnected:
            return None
        except (EngineShutdownError, EngineDeadError) as e:
            raise engine_error(e) from None

    @staticmethod
    async def _stream(streams: list, head: list, chunk, usage_chunk, always_first: bool,
                      with_logprobs: bool, on_output=None) -> AsyncIterator[str]:
        """SSE strings: ``head`` (a chat's role chunks) with the first output, i.e. once the first token exists, as
        OpenAI and vLLM send it (clients time TTFT from the first chunk); then for each new output of prompt ``i``
        and each of its samples ``c`` with something to send (new text, new tokens when ``with_logprobs``, its
        first chunk when ``always_first``, or its finish), ``chunk(i, c, first)``; the usage chunk; ``[DONE]``. An
        engine shutdown or failure ends the stream with an error event. If the consumer stops (client
        disconnected: the response task is cancelled), the requests are aborted. ``on_output(i, out)``, when given, sees each ``RequestOutput`` before its
        chunks."""
        try:
            finals = [None] * len(streams)
            started, done = set(), set()
            async for i, out in merge_streams(streams):
                if head:
                    for h in head:
                        yield h
                    head = []
                if on_output is not None:
                    on_output(i, out)
                for c in out.outputs:
                    key = (i, c.index)
                    first = key not in started
                    finishing = c.finish_reason is not None and key not in done
                    if c.delta_text or finishing or (first and always_first) or (with_logprobs and c.delta_token_ids):
                        started.add(key)
                        if finishing:
                            done.add(key)
                        yield chunk(i, c, first)
                if out.finished:
                    finals[i] = out
            if usage_chunk is not None:
                yield usage_chunk(finals)
            yield SSE_DONE
        except (EngineShutdownError, EngineDeadError) as e:
            yield sse(engine_error(e).body())
            yield SSE_DONE
        finally:
            for s in streams:
                s.abort()


def _texts(value):
    """Every string inside ``value`` (nested dicts and lists), e.g. a conversation's contents."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _texts(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _texts(v)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def include_usage(req) -> bool:
    """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def param_error(e: ParamError, req) -> OpenAIError:
    """An engine ``ParamError`` as a 400 naming the request's own field (``e.field``'s leading name: ``stop`` for
    ``stop[]``): ``max_tokens`` is ``max_completion_tokens`` when the request set that, a chat's ``logprobs`` is
    ``top_logprobs``; a field the request does not have gives ``param: null``. The message names the same field
    (``ParamError.renamed``); nothing reads the message."""
    name = e.field.split("[", 1)[0].split(".", 1)[0]
    param = name
    if name == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"
    elif name == "logprobs" and isinstance(req, p.ChatCompletionRequest):
        param = "top_logprobs"
    if param not in type(req).model_fields:
        return OpenAIError(e.message, param=None)
    if param != name:
        e = e.renamed(param + e.field[len(name):])
    return OpenAIError(e.message, param=param)


#: ``Retry-After`` (seconds) of a 503 while the server shuts down or drains: retry soon, on another replica.
RETRY_AFTER_S = 1


def engine_error(e: BaseException) -> OpenAIError:
    """The HTTP error for an engine that is shutting down or draining (503 with ``Retry-After``) or dead (500)."""
    if isinstance(e, EngineShutdownError):
        return OpenAIError(str(e), status=503, type="server_shutdown", code="aborted",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
    return OpenAIError(f"internal engine error: {e}", status=500, type="internal_server_error")


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------- streams
async def merge_streams(streams: list) -> AsyncIterator[tuple]:
    """Yield ``(index, RequestOutput)`` from several ``OutputStream``s as outputs arrive, until all finish.

    Errors of a stream (shutdown, dead engine) are raised here."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: OutputStream):
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
        except BaseException as e:  # forwarded to the consumer
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def wait_for_disconnect(receive) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect`` (the request body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(coro, receive, streams: list):
    """Await ``coro``; if the client disconnects first, abort ``streams`` and raise ``ClientDisconnected``.
    The streams are aborted on any exit (a no-op for finished ones)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for s in streams:
            s.abort()
        for t in (task, watcher):
            t.cancel()


def sse(obj) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` (every required field written, ``null`` included: see
    ``protocol._Response``)."""
    if isinstance(obj, dict):
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
    return f"data: {obj.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(prompts: list, finals: list) -> p.UsageInfo:
    """Token counts of the finished outputs ``finals`` for ``prompts``."""
    n_prompt = sum(len(pp.token_ids) for pp in prompts)
    n_out = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return p.UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)


def now_s() -> float:
    """``time.monotonic()`` seconds (the engine's clock for arrival times)."""
    return time.monotonic()
