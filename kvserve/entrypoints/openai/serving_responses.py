"""``POST /v1/responses`` (OpenAI's Responses API; vLLM's ``serving_responses``), ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

A request's ``instructions`` and ``input`` (text, or items: messages, ``function_call``, ``function_call_output``,
``reasoning``) become chat messages (after the conversation of ``previous_response_id``), its function ``tools`` and
``tool_choice`` a ``serving_chat.ToolChoice``, ``text.format`` a JSON-schema constraint; one engine request runs
and its events (``kvserve.entrypoints.events``) are rendered by ``ResponseBuilder``: as typed SSE events with
``stream``, else folded into the response object (the same builder run to the end, so both agree). Answers with
``store`` (the default) are kept in a bounded ``ResponseStore``. What OpenAI defines and kvserve cannot do is a 400
naming it (built-in tools, ``background``, ``include`` other than ``reasoning.encrypted_content``, ``truncation:
auto``, ``top_logprobs``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import Field

from kvserve.entrypoints.events import (Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart)
from kvserve.entrypoints.openai.errors import check_fields
from kvserve.entrypoints.openai.protocol import _Strict
from kvserve.entrypoints.openai.responses_items import input_items_of, list_page
from kvserve.entrypoints.openai.responses_store import ResponseStore
from kvserve.entrypoints.openai.serving_chat import ToolChoice
from kvserve.entrypoints.openai.serving_engine import OpenAIError, now_s
from kvserve.entrypoints.openai.serving_events import EventServing
from kvserve.structured import StructuredOutputsParams
from kvserve.validation import ParamError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "structured": "text.format",
         "reasoning_effort": "reasoning.effort"}
#: the fields of each input item type and of a content part (OpenAI's schema, as the ``openai`` client sends them;
#: those kvserve does not use, such as ``phase``, ``caller``, ``namespace``, are accepted and ignored); any other is
#: a 400 naming it
ITEM_FIELDS = {"message": ("type", "role", "content", "id", "status", "phase"),
               "function_call": ("type", "call_id", "name", "arguments", "id", "status", "caller", "namespace"),
               "function_call_output": ("type", "call_id", "output", "id", "status", "caller", "name", "namespace"),
               "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status")}
PART_FIELDS = ("type", "text", "annotations", "logprobs", "prompt_cache_breakpoint")


#: ``include`` values accepted: ``reasoning.encrypted_content`` (what Codex sends with ``store: false``, to carry the
#: reasoning between turns itself) is accepted, as vLLM does, and no encrypted content is returned: a reasoning item
#: has its text in ``content`` and no ``encrypted_content`` (a client sends the item back as it got it).
ACCEPTED_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (OpenAI's fields; ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``,
    ``presence_penalty``, ``frequency_penalty``, ``priority`` are vLLM's extras). Items, tools and ``text`` are
    checked field by field in ``OpenAIServingResponses`` (400s name ``input[2].call_id`` ...)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = Field(..., description="text, or a list of input items")
    instructions: Optional[str] = Field(None, description="a system message before the input (not carried over "
                                                          "by previous_response_id)")
    tools: Optional[list[dict[str, Any]]] = Field(None, description="function tools {type, name, description, "
                                                                    "parameters, strict}")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = Field(None, description="{format: {type: text | json_object | json_schema}}")
    reasoning: Optional[dict[str, Any]] = Field(None, description="{effort, summary}: effort goes to the chat "
                                                                  "template as reasoning_effort; summary is empty")
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = Field(None, description="accepted, not needed: the prefix cache finds shared "
                                                              "prefixes by their content")
    background: Optional[bool] = Field(None, description="not supported (400 when true)")
    include: Optional[list[str]] = Field(None, description="only reasoning.encrypted_content (accepted; kvserve "
                                                             "returns no encrypted content), else a 400")
    truncation: Optional[Literal["auto", "disabled"]] = Field(None, description="only disabled")
    top_logprobs: Optional[int] = Field(None, description="not supported (400 unless 0)")
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    priority: Optional[int] = None


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(message, param=param, code=code)


# ---------------------------------------------------------------------------------------------------- input
def _text_of(content: Any, where: str, kinds: tuple) -> str:
    """A message item's content: a string, or text parts (``input_text`` / ``output_text`` ...) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{at} must be a content part object with a type", at)
        if part["type"] not in kinds:
            raise _bad(f"{at}.type: content part {part['type']!r} is not supported (only {', '.join(kinds)})",
                       f"{at}.type", "unsupported_parameter")
        check_fields(part, PART_FIELDS, at)
        if not isinstance(part.get("text"), str):
            raise _bad(f"{at}.text must be a string", f"{at}.text")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def input_messages(items: Union[str, list]) -> list[dict]:
    """Chat messages (OpenAI's chat shape) of a Responses ``input``: text is one user message; a message item
    keeps its role (system, developer, user, assistant); ``function_call`` items join the assistant message before
    them as ``tool_calls``; a ``function_call_output`` is a ``tool`` message; ``reasoning`` items are not rendered
    (chat templates drop earlier turns' reasoning).

    Raises:
        OpenAIError: 400 naming the item's field (``input[1].call_id``); an unsupported item or part type; a field
            an item or part may not have (``input[0].foo``, ``input[0].content[1].foo``: ``ITEM_FIELDS``).
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind in ITEM_FIELDS:
            check_fields(item, ITEM_FIELDS[kind], where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", kinds + ("text",))
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output", ("input_text",))
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{where}.type: input item {kind!r} is not supported (message, function_call, "
                       f"function_call_output, reasoning)", f"{where}.type", "unsupported_parameter")
    return out


def chat_tools(tools: Optional[list]) -> list[dict]:
    """Responses function tools ``{type: function, name, description?, parameters?, strict?}`` -> OpenAI chat
    tools. Raises ``OpenAIError`` naming ``tools[i]...``; a built-in tool (``web_search``, ``file_search``, ...) is
    refused by name."""
    out = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = t.get("type")
        if kind != "function":
            raise _bad(f"{where}.type: tool type {kind!r} is not supported (only function tools; built-in tools "
                       f"such as web_search or file_search are not available)", f"{where}.type",
                       "unsupported_parameter")
        check_fields(t, ("type", "name", "description", "parameters", "strict"), where)
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.name must be 1-64 of a-z A-Z 0-9 _ -, got {name!r}", f"{where}.name")
        fn: dict = {"name": name}
        for key, typ in (("description", str), ("parameters", dict), ("strict", bool)):
            if t.get(key) is not None:
                if not isinstance(t[key], typ):
                    raise _bad(f"{where}.{key} must be a {typ.__name__}", f"{where}.{key}")
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice: Any) -> Any:
    """Responses ``tool_choice`` -> chat's: a named ``{type: function, name}`` becomes ``{type: function,
    function: {name}}``; other objects (``allowed_tools``, built-in tools) are refused."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
        raise _bad("tool_choice must be none, auto, required or {type: function, name} (other forms are not "
                   "supported)", "tool_choice", "unsupported_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


def text_format_of(text: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """``text.format``: ``text`` (none), ``json_object`` or ``json_schema`` (``schema``) -> the constraint."""
    if not text:
        return None
    extra = sorted(set(text) - {"format"})
    if extra:
        raise _bad(f"text.{extra[0]} is not supported", f"text.{extra[0]}", "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema must be a JSON schema object", "text.format.schema")
        try:
            return StructuredOutputsParams(json=schema)
        except ParamError as e:
            raise _bad(e.with_prefix("structured_outputs.json", "text.format.schema").message, "text.format") from None
    raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")


# ---------------------------------------------------------------------------------------------------- output
class ResponseBuilder:
    """Renders events into the Responses API: ``feed(event)`` returns the typed stream events it causes (dicts
    with ``type`` and ``sequence_number``) and updates ``response`` (the object ``response.completed`` carries
    and a non-streamed answer is). Output items open in the order the events begin them: reasoning, message,
    function calls."""

    def __init__(self, response: dict, input_items: Optional[list] = None):
        self.response = response
        self.input_items = input_items or []  # the request's input (``responses_items.input_items_of``)
        self.seq = 0
        self.open: Optional[int] = None  # index in output of the open reasoning / message item
        self.calls: dict = {}  # tool-call index -> output index (open until the end or the next item)
        self.finish: Optional[Finish] = None

    @property
    def output(self) -> list:
        return self.response["output"]

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self.event("response.created", response=_copy(self.response)),
                self.event("response.in_progress", response=_copy(self.response))]

    def feed(self, e) -> list[dict]:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            return self._text(e)
        if isinstance(e, ToolCallStart):
            out = self._close()
            item = {"id": _new("fc"), "type": "function_call", "status": "in_progress", "call_id": e.id,
                    "name": e.name, "arguments": ""}
            self.output.append(item)
            self.calls[e.index] = len(self.output) - 1
            return out + [self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(item))]
        if isinstance(e, ToolCallArgsDelta):
            k = self.calls[e.index]
            self.output[k]["arguments"] += e.arguments
            return [self.event("response.function_call_arguments.delta", item_id=self.output[k]["id"],
                               output_index=k, delta=e.arguments)]
        if isinstance(e, Finish):
            self.finish = e
        return []

    def _text(self, e) -> list[dict]:
        reasoning = isinstance(e, ReasoningDelta)
        kind = "reasoning" if reasoning else "message"
        out = []
        if self.open is None or self.output[self.open]["type"] != kind:
            out = self._close()
            if reasoning:
                item = {"id": _new("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output.append(item)
            self.open = k = len(self.output) - 1
            out.append(self.event("response.output_item.added", output_index=k, item=_copy(item)))
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=k,
                                  content_index=0, part=dict(part)))
        k = self.open
        item = self.output[k]
        item["content"][0]["text"] += e.text
        kind = "response.reasoning_text.delta" if reasoning else "response.output_text.delta"
        extra = {} if reasoning else {"logprobs": []}
        out.append(self.event(kind, item_id=item["id"], output_index=k, content_index=0, delta=e.text, **extra))
        return out

    def _close(self) -> list[dict]:
        """Done events of the open items (text or reasoning, then function calls)."""
        out = []
        if self.open is not None:
            k, self.open = self.open, None
            item = self.output[k]
            part = item["content"][0]
            reasoning = item["type"] == "reasoning"
            kind = "response.reasoning_text.done" if reasoning else "response.output_text.done"
            extra = {} if reasoning else {"logprobs": []}
            out.append(self.event(kind, item_id=item["id"], output_index=k, content_index=0, text=part["text"],
                                  **extra))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=k,
                                  content_index=0, part=dict(part)))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=k, item=_copy(item)))
        for k in self.calls.values():
            item = self.output[k]
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                  name=item["name"], arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=k, item=dict(item)))
        self.calls = {}
        return out

    def end(self, usage: dict) -> list[dict]:
        """Close every item, set ``status`` (``completed``; ``incomplete`` with ``incomplete_details`` when
        ``max_output_tokens`` cut it; ``cancelled`` without a finish) and ``usage``; the last events."""
        out = self._close()
        reason = self.finish.finish_reason if self.finish is not None else None
        r = self.response
        r["usage"] = usage
        if reason == "length":
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        elif reason in (None, "abort"):
            r["status"] = "cancelled"
        else:
            r["status"] = "completed"
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(r["status"],
                                                                                           "response.failed")
        return out + [self.event(kind, response=_copy(r))]


def _copy(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def output_messages(output: list) -> list[dict]:
    """A response's output as chat messages (for ``previous_response_id``): one assistant message with its text
    and its function calls (reasoning is not rendered)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    m: dict = {"role": "assistant", "content": text or None}
    if calls:
        m["tool_calls"] = calls
    return [m]


# ---------------------------------------------------------------------------------------------------- serving
class OpenAIServingResponses(EventServing):
    """The Responses endpoints (arguments: ``EventServing``'s, and ``store``: the ``ResponseStore``)."""

    def __init__(self, llm, served_model_name: str, vocab=None, limits=None, options=None,
                 store: Optional[ResponseStore] = None):
        super().__init__(llm, served_model_name, vocab, limits, options)
        self.store = store if store is not None else ResponseStore()
        self.in_flight: dict = {}  # response id -> (EventStream, ResponseBuilder)

    def check_request(self, req: ResponsesRequest) -> None:
        """400 for what kvserve cannot do (named) and for requests over the server's bounds."""
        if req.background:
            raise _bad("background responses are not supported", "background", "unsupported_parameter")
        for i, what in enumerate(req.include or []):  # Codex sends reasoning.encrypted_content with store: false
            if what not in ACCEPTED_INCLUDES:
                raise _bad(f"include {what!r} is not supported (accepted: {', '.join(ACCEPTED_INCLUDES)})",
                           "include", "unsupported_parameter")
        if req.truncation == "auto":
            raise _bad("truncation 'auto' is not supported (a prompt that does not fit is a 400)", "truncation",
                       "unsupported_parameter")
        if req.top_logprobs:
            raise _bad("top_logprobs is not supported on /v1/responses", "top_logprobs", "unsupported_parameter")
        if req.priority and self.llm.model_info.scheduling_policy != "priority":
            raise _bad("priority needs the server to run with --scheduling-policy priority", "priority",
                       "unsupported_parameter")
        if req.reasoning is not None:
            extra = sorted(set(req.reasoning) - {"effort", "summary", "generate_summary"})
            if extra:
                raise _bad(f"reasoning.{extra[0]} is not supported", f"reasoning.{extra[0]}", "unsupported_parameter")
            effort = req.reasoning.get("effort")
            if effort not in (None, "minimal", "low", "medium", "high"):
                raise _bad(f"reasoning.effort must be minimal, low, medium or high, got {effort!r}", "reasoning.effort")
        self.limits.check_tools(req.tools or [], "tools")
        if req.text is not None:
            self.limits.check_schema(req.text, "text.format")

    async def create_response(self, req: ResponsesRequest, receive):
        """``POST /v1/responses``: the response object, an async iterator of SSE strings (``stream``), or ``None``
        if the client went away (its request aborted).

        Raises:
            OpenAIError: 400 (bad or unsupported input), 404 (unknown ``previous_response_id``), 503 / 500.
        """
        arrival = now_s()
        self.check_model(req.model)
        self.check_request(req)
        previous: list = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise OpenAIError(f"previous response {req.previous_response_id!r} not found (never stored, "
                                  f"deleted or expired)", param="previous_response_id", status=404,
                                  type="not_found_error")
            previous = stored.conversation
        conversation = previous + input_messages(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        tools = ToolChoice.create(chat_tools(req.tools), tool_choice_of(req.tool_choice), req.parallel_tool_calls,
                                  **self.tool_parser_args(),
                                  alternatives='tool_choice "required", "none" or {"type": "function", "name": ...}')
        effort = (req.reasoning or {}).get("effort")
        kwargs = {"reasoning_effort": effort} if effort else None
        pp, sp = await self.prepare(messages, tools, text_format_of(req.text), {
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "seed": req.seed,
        }, req.max_output_tokens, NAMES, kwargs)
        rid = _new("resp")
        builder = ResponseBuilder(self._skeleton(rid, req, sp), input_items_of(req.input))
        events = await self.open(pp, sp, rid, arrival, tools, NAMES, req.priority or 0, kwargs)
        self.in_flight[rid] = (events, builder)

        def finish(final) -> list[dict]:
            self.in_flight.pop(rid, None)
            n_out = len(final.outputs[0].token_ids) if final is not None else 0
            reasoning = "".join(p["text"] for item in builder.output if item["type"] == "reasoning"
                                for p in item["content"])
            usage = {"input_tokens": len(pp.token_ids), "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": len(self.tokenizer.encode(
                         reasoning, add_special_tokens=False)) if reasoning else 0},
                     "total_tokens": len(pp.token_ids) + n_out}
            out = builder.end(usage)
            if req.store:
                self.store.put(builder.response, conversation + output_messages(builder.output), builder.input_items)
            return out

        if not req.stream:
            try:
                got = await self.collect(events, receive)
            finally:
                self.in_flight.pop(rid, None)
            if got is None:
                return None
            evs, final = got
            for e in evs:
                builder.feed(e)
            finish(final)
            return builder.response

        async def sse():
            final = None
            try:
                for e in builder.start():
                    yield _sse(e)
                async for evs, out in events:
                    final = out
                    for e in evs:
                        for ev in builder.feed(e):
                            yield _sse(ev)
                for ev in finish(final):
                    yield _sse(ev)
            except OpenAIError as e:
                yield _sse(builder.event("error", code=e.code, message=e.message, param=e.param,
                                         error=e.body()["error"]))
            finally:
                self.in_flight.pop(rid, None)
                events.abort()

        return sse()

    def _skeleton(self, rid: str, req: ResponsesRequest, sp) -> dict:
        """The response object before any output (``status: in_progress``)."""
        reasoning = req.reasoning or {}
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.model_name, "output": [],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
                "store": bool(req.store), "temperature": sp.temperature, "top_p": sp.top_p,
                "text": {"format": fmt}, "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
                "tools": req.tools or [], "truncation": "disabled", "usage": None, "user": req.user,
                "metadata": req.metadata or {}}

    def retrieve(self, rid: str) -> dict:
        """``GET /v1/responses/{id}``: a stored response (in flight: as it stands). Raises a 404."""
        if rid in self.in_flight:
            return _copy(self.in_flight[rid][1].response)
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return stored.response

    def input_items(self, rid: str, query: dict) -> dict:
        """``GET /v1/responses/{id}/input_items``: the request's input items of a stored (or in-flight) response,
        as OpenAI's list (``responses_items.list_page``: ``query`` its ``limit``, ``order``, ``after``). Raises a
        404 for an unknown id, a 400 naming a bad query parameter."""
        if rid in self.in_flight:
            items = self.in_flight[rid][1].input_items
        else:
            stored = self.store.get(rid)
            if stored is None:
                raise _not_found(rid)
            items = stored.input_items
        return list_page(items, query)

    def cancel(self, rid: str) -> dict:
        """``POST /v1/responses/{id}/cancel``: abort a response still being generated (its stream ends, status
        ``cancelled``); a finished one is a 400, an unknown one a 404."""
        if rid in self.in_flight:
            events, builder = self.in_flight.pop(rid)
            events.abort()
            return {**_copy(builder.response), "status": "cancelled"}
        if self.store.get(rid) is None:
            raise _not_found(rid)
        raise OpenAIError(f"response {rid!r} is not in progress; only a response being generated can be "
                          f"cancelled", param="response_id")

    def delete(self, rid: str) -> dict:
        """``DELETE /v1/responses/{id}``. Raises a 404 for an unknown id."""
        if not self.store.delete(rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}


def _not_found(rid: str) -> OpenAIError:
    return OpenAIError(f"response {rid!r} not found", param="response_id", status=404, type="not_found_error")


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
