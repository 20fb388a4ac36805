"""Chat messages -> the conversation a chat template renders: one rule for the offline ``LLM.chat`` and the server.

A message is ``{"role", "content"}`` (plus an optional ``name``, accepted and not rendered):

- ``role``: ``system``, ``developer`` (rendered as ``system``), ``user`` or ``assistant``;
- ``content``: a string, or a list of text parts ``{"type": "text", "text": str}`` (joined); ``null`` only for an
  ``assistant`` message (rendered as empty text), as in OpenAI's API;
- every string valid Unicode (no lone surrogates: ``check_text``).

Anything else raises ``MessageError`` (a ``ValueError``) whose ``param`` names the field, e.g. ``messages[1].content``.
"""

from __future__ import annotations

from typing import Any, Optional

from kvserve.validation import check_text

ROLES = ("system", "developer", "user", "assistant")
_KEYS = ("role", "content", "name")


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
        conversation.append({"role": "system" if role == "developer" else role,
                             "content": _content(m.get("content"), role, where)})
    return conversation


def _content(content: Any, role: str, where: str) -> str:
    param = f"{where}.content"
    if content is None:
        if role == "assistant":
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
