"""Chat messages -> the conversation a chat template renders: one rule for the offline ``LLM.chat`` and the server;
and the rendering itself (``render_chat``, with the template ``chat_template_for`` picks: ``--chat-template``, else
the model's own, else ``NoChatTemplateError``).

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

from kvserve.validation import check_text

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


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
    """``tool_calls`` of an assistant message (arguments parsed) / ``tool_call_id`` of a tool message."""
    out = {}
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


# ---------------------------------------------------------------------------------------------------- templates
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


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


class NoChatTemplateError(ValueError):
    """The model has no chat template and none was given (a 400 on ``/v1/chat/completions``)."""


NO_CHAT_TEMPLATE = ("this model has no chat template (none in its files: a GGUF's tokenizer.chat_template, or "
                    "tokenizer_config.json's chat_template / chat_template.jinja in a Hugging Face directory), so "
                    "chat messages cannot be turned into a prompt; pass one with --chat-template FILE (kvserve "
                    "serve / generate) or LLM(chat_template=...) / LLM.chat(chat_template=...), or send the prompt "
                    "text to /v1/completions")


def chat_template_for(tokenizer, chat_template: Optional[str] = None, tools: Optional[list] = None) -> str:
    """The Jinja text that renders a conversation: ``chat_template`` when given (``--chat-template``), else the
    tokenizer's own -- of several named ones (a GGUF's ``tokenizer.chat_template.<name>``, a directory's
    ``chat_templates/``), ``tool_use`` when there are ``tools`` and it exists, else ``default`` (transformers'
    rule).

    Raises:
        NoChatTemplateError: neither exists (the message says how to pass one).
    """
    if chat_template:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("tool_use") if tools and own.get("tool_use") else own.get("default")
    if not isinstance(own, str) or not own:
        raise NoChatTemplateError(NO_CHAT_TEMPLATE)
    return own


def render_chat(tokenizer, conversation: list[dict], tools: Optional[list] = None,
                chat_template: Optional[str] = None, **kwargs) -> str:
    """The chat template's text for ``conversation`` (from ``conversation_from_messages``) and OpenAI ``tools``.

    The template is ``chat_template_for(tokenizer, chat_template, tools)``. One that knows tools (mentions
    ``tools``) gets them (``apply_chat_template(tools=...)``). Otherwise (SmolLM2's template ignores tools and
    tool calls) the conversation is rewritten in the Hermes convention first: the tools and the ``<tool_call>``
    format go into the system message (``TOOLS_PROMPT``), an assistant's tool calls become
    ``<tool_call>{...}</tool_call>`` text, and a tool result becomes a user turn ``<tool_response>...``.
    ``kwargs`` go to ``apply_chat_template`` (``add_generation_prompt`` ...).

    Raises:
        NoChatTemplateError: no template (see ``chat_template_for``); whatever the template raises
            (``raise_exception``: a ``jinja2`` error).
    """
    template = chat_template_for(tokenizer, chat_template, tools)
    if "tools" in template:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             chat_template=template, **kwargs)
    conv = []
    for m in conversation:
        if m.get("tool_calls"):
            blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]})
                                + "\n</tool_call>" for c in m["tool_calls"])
            conv.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + blocks})
        elif m["role"] == "tool":
            conv.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            conv.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if conv and conv[0]["role"] == "system":
            conv[0] = {"role": "system", "content": conv[0]["content"] + "\n\n" + prompt}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return tokenizer.apply_chat_template(conv, tokenize=False, chat_template=template, **kwargs)


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
