"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API, what Claude Code and the
``anthropic`` client speak).

``system`` and ``messages`` (text, ``tool_use``, ``tool_result`` blocks; ``thinking`` blocks of earlier turns are
not rendered) become chat messages, ``tools`` / ``tool_choice`` a ``serving_chat.ToolChoice`` (``any`` is OpenAI's
``required``, ``{type: tool, name}`` a named call), ``stop_sequences`` the stop strings; one engine request runs and
its events (``kvserve.entrypoints.events``) are rendered by ``MessageBuilder``: Anthropic's SSE events with
``stream``, else folded into the message (the same builder run to the end). ``thinking`` (``{type: enabled,
budget_tokens}``) needs ``--reasoning-parser``: the template is asked to think (``enable_thinking``) and the
reasoning comes back as ``thinking`` blocks. Errors take Anthropic's shape (``errors.anthropic_body``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Union

from pydantic import Field

from kvserve.entrypoints.events import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from kvserve.entrypoints.openai.errors import anthropic_body, check_fields
from kvserve.entrypoints.openai.protocol import _Strict
from kvserve.entrypoints.openai.serving_chat import ToolChoice
from kvserve.entrypoints.openai.serving_engine import OpenAIError, now_s
from kvserve.entrypoints.openai.serving_events import EventServing

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NAMES = {"messages": "messages", "max_tokens": "max_tokens", "structured": "tools", "stop": "stop_sequences",
         "thinking_token_budget": "thinking.budget_tokens"}
#: the fields of a message, of each content block type and of a tool (Anthropic's schema, as the ``anthropic``
#: client sends them: a ``tool_use`` block it returned comes back with ``caller``); any other is a 400 naming it
#: (``errors.check_fields``). Those kvserve does not use (``cache_control``, ``citations``, ``caller``,
#: ``toolset_name``, a tool's ``strict``, ``input_examples``, ``defer_loading``, ...) are accepted and ignored.
MESSAGE_FIELDS = ("role", "content")
BLOCK_FIELDS = {"text": ("type", "text", "cache_control", "citations"),
                "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
                "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
                "thinking": ("type", "thinking", "signature"),
                "redacted_thinking": ("type", "data")}
TOOL_FIELDS = ("type", "name", "description", "input_schema", "cache_control", "strict", "input_examples",
               "defer_loading", "eager_input_streaming", "allowed_callers")
#: the ``tool_choice`` values that work without ``--enable-auto-tool-choice`` (suggested by the 400 of ``auto``)
ALTERNATIVES = 'tool_choice {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'


class MessagesRequest(_Strict):
    """``POST /v1/messages``: Anthropic's fields. Blocks and tools are checked field by field in
    ``AnthropicServingMessages`` (400s name ``messages[1].content[0].tool_use_id`` ...)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int = Field(..., description="tokens to generate at most (>= 1)")
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = Field(None, description="{type: enabled, budget_tokens} or {type: disabled}")
    metadata: Optional[dict[str, Any]] = Field(None, description="accepted and not used (user_id)")


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the prompt fields of ``MessagesRequest``."""

    model: str
    messages: list[dict[str, Any]]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param=param)


def _text_blocks(content: Any, where: str) -> str:
    """A string, or ``text`` blocks joined (``cache_control`` and ``citations`` accepted, not used)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}[{j}] must be a text block {{type: text, text}}", f"{where}[{j}]")
        check_fields(b, BLOCK_FIELDS["text"], f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


def chat_messages(system: Any, messages: list) -> list[dict]:
    """Anthropic ``system`` + ``messages`` -> chat messages: a user turn's ``tool_result`` blocks become ``tool``
    messages (in order, before its text), an assistant turn's ``tool_use`` blocks its ``tool_calls``
    (``input`` as JSON text); ``thinking`` / ``redacted_thinking`` blocks are not rendered.

    Raises:
        OpenAIError: 400 naming the block's field; an unsupported block (image, document, ...) by name.
    """
    out: list[dict] = []
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        check_fields(m, MESSAGE_FIELDS, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user or assistant, got {role!r}", f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        text, calls, results = [], [], []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind in BLOCK_FIELDS:
                check_fields(b, BLOCK_FIELDS[kind], at)
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _bad(f"{at}: a tool_use block needs string id and name", f"{at}.id")
                if not isinstance(b.get("input"), dict):
                    raise _bad(f"{at}.input must be an object", f"{at}.input")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
                result = _text_blocks(b.get("content", ""), f"{at}.content")
                if b.get("is_error") is True:
                    result = f"Error: {result}"
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise _bad(f"{at}.type: content block {kind!r} is not supported in a {role} message (text, "
                           f"tool_use in assistant, tool_result in user, thinking)", f"{at}.type")
        out += results
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    return out


def chat_tools(tools: Optional[list]) -> list[dict]:
    """Anthropic tools ``{name, description?, input_schema, type?: custom}`` -> OpenAI chat tools. Server tools
    (``web_search_...``, ``bash_...``, ``text_editor_...``, ``computer_...``, ``code_execution_...``) are refused
    by name."""
    out = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = t.get("type", "custom")
        if kind != "custom":
            raise _bad(f"{where}.type: tool {kind!r} is not supported (only custom tools with an input_schema; "
                       f"server tools are not available)", f"{where}.type")
        check_fields(t, TOOL_FIELDS, where)
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.name must be 1-64 of a-z A-Z 0-9 _ -, got {name!r}", f"{where}.name")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
        fn: dict = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise _bad(f"{where}.description must be a string", f"{where}.description")
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice: Optional[dict]) -> tuple[Any, Optional[bool]]:
    """Anthropic ``tool_choice`` -> (chat ``tool_choice``, ``parallel_tool_calls``): ``auto`` -> auto, ``any`` ->
    required, ``{type: tool, name}`` -> the named function, ``none`` -> none; ``disable_parallel_tool_use`` ->
    ``parallel_tool_calls: false``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice.type")


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class MessageBuilder:
    """Renders events into Anthropic's Messages API: ``feed(event)`` returns the SSE events it causes and updates
    ``message`` (the object a non-streamed answer is). Blocks open in the order the events begin them: thinking,
    text, tool_use; a ``tool_use`` block's ``input`` is its arguments parsed when the block ends (``{}`` for
    arguments cut short by ``max_tokens``, which ``stop_reason: max_tokens`` says)."""

    def __init__(self, message: dict, stop_sequences: list):
        self.message = message
        self.stop_sequences = stop_sequences
        self.open: Optional[int] = None  # index of the open thinking / text block
        self.calls: dict = {}  # tool-call index -> (block index, arguments so far)

    @property
    def content(self) -> list:
        return self.message["content"]

    def start(self) -> list[tuple]:
        return [("message_start", {"type": "message_start", "message": json.loads(json.dumps(self.message))})]

    def feed(self, e) -> list[tuple]:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            thinking = isinstance(e, ReasoningDelta)
            kind = "thinking" if thinking else "text"
            out = []
            if self.open is None or self.content[self.open]["type"] != kind:
                out = self._close()
                block = {"type": "thinking", "thinking": "", "signature": ""} if thinking else {"type": "text",
                                                                                               "text": ""}
                self.content.append(block)
                self.open = len(self.content) - 1
                out.append(self._block_start(self.open, dict(block)))
            self.content[self.open][kind] += e.text
            delta = {"type": "thinking_delta", "thinking": e.text} if thinking else {"type": "text_delta",
                                                                                    "text": e.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.open, "delta": delta}))
            return out
        if isinstance(e, ToolCallStart):
            out = self._close()
            block = {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
            self.content.append(block)
            self.calls[e.index] = [len(self.content) - 1, ""]
            return out + [self._block_start(len(self.content) - 1, dict(block))]
        if isinstance(e, ToolCallArgsDelta):
            entry = self.calls[e.index]
            entry[1] += e.arguments
            return [("content_block_delta", {"type": "content_block_delta", "index": entry[0],
                                             "delta": {"type": "input_json_delta", "partial_json": e.arguments}})]
        if isinstance(e, Finish):
            reason = _STOP.get(e.finish_reason, "end_turn")
            if isinstance(e.stop_reason, str) and e.stop_reason in self.stop_sequences:
                reason = "stop_sequence"
                self.message["stop_sequence"] = e.stop_reason
            self.message["stop_reason"] = reason
        return []

    @staticmethod
    def _block_start(index: int, block: dict) -> tuple:
        return ("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    def _close(self) -> list[tuple]:
        out = []
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.open}))
            self.open = None
        for index, args in self.calls.values():
            try:
                value = json.loads(args) if args else {}
            except ValueError:
                value = {}
            self.content[index]["input"] = value if isinstance(value, dict) else {}
            out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self.calls = {}
        return out

    def end(self, output_tokens: int) -> list[tuple]:
        """Close every block; ``message_delta`` (``stop_reason``, ``stop_sequence``, usage) and ``message_stop``."""
        out = self._close()
        self.message["usage"]["output_tokens"] = output_tokens
        if self.message["stop_reason"] is None:
            self.message["stop_reason"] = "end_turn"
        delta = {"stop_reason": self.message["stop_reason"], "stop_sequence": self.message["stop_sequence"]}
        return out + [("message_delta", {"type": "message_delta", "delta": delta,
                                         "usage": {"output_tokens": output_tokens}}),
                      ("message_stop", {"type": "message_stop"})]


class AnthropicServingMessages(EventServing):
    """The Messages endpoints (arguments: ``EventServing``'s)."""

    def _prompt_fields(self, req) -> tuple[list, ToolChoice, Optional[dict]]:
        """Messages, tool mode and chat-template variables of a request (``MessagesRequest`` or
        ``CountTokensRequest``). Raises ``OpenAIError`` (400)."""
        self.limits.check_tools(req.tools or [], "tools")
        choice, parallel = tool_choice_of(req.tool_choice)
        tools = ToolChoice.create(chat_tools(req.tools), choice, parallel, **self.tool_parser_args(),
                                  alternatives=ALTERNATIVES)
        messages = chat_messages(req.system, req.messages)
        if not messages:
            raise _bad("messages must not be empty", "messages")
        kwargs = None
        thinking = req.thinking
        if thinking is not None:
            kind = thinking.get("type")
            if kind not in ("enabled", "disabled"):
                raise _bad("thinking.type must be enabled or disabled", "thinking.type")
            if kind == "enabled":
                if self.options.reasoning_parser is None:
                    raise _bad("thinking needs the server to run with --reasoning-parser (this model's reasoning "
                               "cannot be told from its answer otherwise)", "thinking")
                budget = thinking.get("budget_tokens")
                if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                    raise _bad(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}",
                               "thinking.budget_tokens")
        if self.options.reasoning_parser is not None:  # thinking models' templates switch on this variable
            kwargs = {"enable_thinking": bool(thinking and thinking.get("type") == "enabled")}
        return messages, tools, kwargs

    async def create_message(self, req: MessagesRequest, receive):
        """``POST /v1/messages``: the message, an async iterator of SSE strings (``stream``), or ``None`` if the
        client went away (its request aborted). Raises ``OpenAIError`` (answered in Anthropic's shape)."""
        arrival = now_s()
        self.check_model(req.model)
        self.limits.check_stop(req.stop_sequences, "stop_sequences")
        if req.temperature is not None and not 0 <= req.temperature <= 1:
            raise _bad(f"temperature must be in [0, 1] (Anthropic's range), got {req.temperature}", "temperature")
        messages, tools, kwargs = self._prompt_fields(req)
        if req.thinking and req.thinking.get("type") == "enabled" and req.thinking["budget_tokens"] >= req.max_tokens:
            raise _bad("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
        budget = req.thinking["budget_tokens"] if req.thinking and req.thinking.get("type") == "enabled" else None
        pp, sp = await self.prepare(messages, tools, None, {  # the budget: enforced in the sampler
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
            "thinking_token_budget": budget,
        }, req.max_tokens, NAMES, kwargs)
        msg_id = f"msg_{uuid.uuid4().hex}"
        message = {"id": msg_id, "type": "message", "role": "assistant", "model": self.model_name, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(pp.token_ids), "output_tokens": 0}}
        builder = MessageBuilder(message, list(sp.stop))
        events = await self.open(pp, sp, msg_id, arrival, tools, NAMES, chat_template_kwargs=kwargs)

        if not req.stream:
            got = await self.collect(events, receive)
            if got is None:
                return None
            evs, final = got
            for e in evs:
                builder.feed(e)
            builder.end(len(final.outputs[0].token_ids) if final is not None else 0)
            return builder.message

        async def sse():
            final = None
            try:
                for name, data in builder.start():
                    yield _sse(name, data)
                yield _sse("ping", {"type": "ping"})
                async for evs, out in events:
                    final = out
                    for e in evs:
                        for name, data in builder.feed(e):
                            yield _sse(name, data)
                for name, data in builder.end(len(final.outputs[0].token_ids) if final is not None else 0):
                    yield _sse(name, data)
            except OpenAIError as e:
                yield _sse("error", anthropic_body(e))
            finally:
                events.abort()

        return sse()

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, the prompt ``/v1/messages`` would run."""
        self.check_model(req.model)
        messages, tools, kwargs = self._prompt_fields(req)
        pp = await self.chat_prompt(messages, tools=tools.prompt_tools, chat_template_kwargs=kwargs)
        return {"input_tokens": len(pp.token_ids)}


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
