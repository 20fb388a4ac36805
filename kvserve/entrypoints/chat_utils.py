"""Chat messages -> the conversation a chat template renders: one rule for the offline ``LLM.chat`` and the server.
The rendering itself (``render_chat``, ``chat_template_for``) is the engine's (``kvserve.engine.chat_render``,
re-exported here): the server reaches it through ``EngineClient.render_chat``.

A message is ``{"role", "content"}`` (plus an optional ``name``, accepted and not rendered):

- ``role``: ``system``, ``developer`` (rendered as ``system``), ``user``, ``assistant`` or ``tool`` (a tool's
  result, with an optional ``tool_call_id``); an assistant message may carry ``tool_calls``
  (``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``, passed to the template with
  ``arguments`` parsed, the Hugging Face convention);
- ``content``: a string, or a list of text parts ``{"type": "text", "text": str}`` (joined); ``null`` only for an
  ``assistant`` message (rendered as empty text), as in OpenAI's API;
- every string valid Unicode (no lone surrogates: ``check_text``).

Anything else raises ``MessageError`` (a ``ValueError``) whose ``param`` names the field, e.g. ``messages[1].content``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvserve.engine.chat_render import (NO_CHAT_TEMPLATE, TOOLS_PROMPT, NoChatTemplateError,  # noqa: F401
                                        chat_template_for, render_chat)
from kvserve.validation import check_text

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")


class MessageError(ValueError):
    """A malformed message; ``param`` is the offending field (``messages[i].content`` ...)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def conversation_from_messages(messages: Any) -> list[dict]:
    """Validate ``messages`` (a list of dicts) and return ``[{"role", "content": str}]`` for the chat template.

    Raises:
        MessageError: an empty or non-list ``messages``, an unknown key or role, content that is neither a string
            nor a list of text parts (or ``null`` outside an assistant message), a part without a ``text``
            string, a lone surrogate in any string.
    """
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list of {'role': str, 'content': str} objects", "messages")
    conversation = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}", where)
        unknown = sorted(str(k) for k in m if k not in _KEYS)
        if unknown:
            raise MessageError(f"{where}: unrecognized message field(s) {unknown}; allowed: {list(_KEYS)}",
                               f"{where}.{unknown[0]}")
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise MessageError(f"{where}.name must be a string, got {type(name).__name__}", f"{where}.name")
            _check(f"{where}.name", name)
        item = {"role": "system" if role == "developer" else role,
                "content": _content(m.get("content"), role, where, bool(m.get("tool_calls")))}
        item.update(_tool_fields(m, role, where))
        conversation.append(item)
    return conversation


def _tool_fields(m: dict, role: str, where: str) -> dict:
    """``tool_calls`` of an assistant message (arguments parsed) and its earlier reasoning (``reasoning_content``, or
    its newer name ``reasoning``: ``reasoning_content`` in the result) / ``tool_call_id`` of a tool message."""
    out = {}
    for key in ("reasoning_content", "reasoning"):
        text = m.get(key)
        if text is None:
            continue
        if role != "assistant" or not isinstance(text, str):
            raise MessageError(f"{where}.{key} must be a string, in an assistant message", f"{where}.{key}")
        _check(f"{where}.{key}", text)
        out["reasoning_content"] = text
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise MessageError(f"{where}.tool_calls is only allowed in an assistant message", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise MessageError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            at = f"{where}.tool_calls[{j}].function"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise MessageError(f"{at} must be {{'name': str, 'arguments': str}}", at)
            _check(f"{at}.name", fn["name"])
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise MessageError(f"{at}.arguments must be a JSON text of an object", f"{at}.arguments") from None
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": args}})
    call_id = m.get("tool_call_id")
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str):
            raise MessageError(f"{where}.tool_call_id must be a string, in a tool message", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    return out


def check_tools(tools: Any) -> Optional[list[dict]]:
    """OpenAI ``tools`` (``[{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}]``) validated by the server's own model (``protocol.ChatTool``: strict types, no unknown field)
    and returned as the dicts the server renders (unset fields left out); ``None`` stays ``None``.

    Raises:
        MessageError: not a list, or an entry that does not fit (``param`` names it, e.g.
            ``tools[0].function.name``).
    """
    if tools is None:
        return None
    # the server's pydantic models, imported only when tools are given (``kvserve generate`` never needs them)
    from pydantic import TypeAdapter, ValidationError

    from kvserve.entrypoints.openai.protocol import ChatTool

    if not isinstance(tools, list):
        raise MessageError(f"tools must be a list of {{'type': 'function', 'function': {{'name': str, ...}}}} "
                           f"objects, got {type(tools).__name__}", "tools")
    try:
        parsed = TypeAdapter(list[ChatTool]).validate_python(tools)
    except ValidationError as e:
        err = e.errors()[0]
        where = "tools" + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        raise MessageError(f"{where}: {err['msg']}", where) from None
    for i, t in enumerate(parsed):
        _check(f"tools[{i}].function.name", t.function.name)
    return [t.model_dump(exclude_none=True) for t in parsed]


def _content(content: Any, role: str, where: str, has_tool_calls: bool = False) -> str:
    param = f"{where}.content"
    if content is None:
        if role == "assistant" or has_tool_calls:
            return ""
        raise MessageError(f"{param} must be a string or a list of text parts; null is allowed only in an "
                           f"assistant message, this one has role {role!r}", param)
    if isinstance(content, str):
        _check(param, content)
        return content
    if not isinstance(content, list):
        raise MessageError(f"{param} must be a string or a list of text parts, got {type(content).__name__}", param)
    texts = []
    for j, part in enumerate(content):
        at = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise MessageError(f"{at}: only text parts {{'type': 'text', 'text': str}} are supported, got "
                               f"{'type ' + repr(kind) if isinstance(part, dict) else type(part).__name__}", param)
        text: Optional[str] = part.get("text")
        if not isinstance(text, str):
            raise MessageError(f"{at}: a text part needs a 'text' string, got "
                               f"{'no text' if text is None else type(text).__name__}", param)
        _check(f"{at}.text", text, param)
        texts.append(text)
    return "".join(texts)


def _check(name: str, value: str, param: Optional[str] = None) -> None:
    try:
        check_text(name, value)
    except ValueError as e:
        raise MessageError(str(e), param or name) from None
