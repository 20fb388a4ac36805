"""``GET /v1/responses/{id}/input_items`` (OpenAI's ``client.responses.input_items.list``): a response's input as
items (``input_items_of``, kept with the response) and OpenAI's cursor-paged list of them (``list_page``:
``{"object": "list", "data", "first_id", "last_id", "has_more"}``; query ``limit`` 1..100, default 20, ``order``
``asc`` or ``desc`` (the default, newest first), ``after`` an item id).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any, Optional, Union

from kvserve.entrypoints.openai.errors import OpenAIError, unrecognized_argument

#: id prefix of each item type (OpenAI's spelling where it has one)
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
LIST_PARAMS = ("limit", "order", "after")


def input_items_of(given: Union[str, list[dict[str, Any]]]) -> list[dict]:
    """The items of a Responses ``input`` as the input-items list shows them: text is one user message; each item
    is a copy with its ``type`` (``message`` when left out), an ``id`` (its own, else a new ``msg_`` / ``fc_`` /
    ``fco_`` / ``rs_`` one) and ``status: completed`` (unless it has one); a message's string content becomes one
    ``input_text`` part (``output_text`` for an assistant message)."""
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    out = []
    for item in items:
        item = copy.deepcopy(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            assistant = item.get("role") == "assistant"
            part = {"type": "output_text", "text": item["content"], "annotations": []} if assistant else {
                "type": "input_text", "text": item["content"]}
            item["content"] = [part]
        item.setdefault("id", f"{_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        item.setdefault("status", "completed")
        out.append(item)
    return out


def list_page(items: list[dict], query: dict[str, str]) -> dict:
    """OpenAI's list object of ``items`` (each with an ``id``; oldest first) for the query parameters ``query``.

    Raises:
        OpenAIError: 400 naming the parameter: ``limit`` not an integer in [1, 100], ``order`` not ``asc`` /
            ``desc``, ``after`` not an id of these items, or any other parameter (``unrecognized_argument``).
    """
    extra = sorted(k for k in query if k not in LIST_PARAMS)
    if extra:
        raise unrecognized_argument(extra[0])
    limit: Optional[str] = query.get("limit")
    if limit is not None and not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise OpenAIError(f"limit must be an integer in [1, 100], got {limit!r}", param="limit")
    n = 20 if limit is None else int(limit)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(f"order must be asc or desc, got {order!r}", param="order")
    seq = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in seq]
        if after not in ids:
            raise OpenAIError(f"after: {after!r} is not the id of an item of this response's input", param="after")
        seq = seq[ids.index(after) + 1:]
    page = seq[:n]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(seq) > n}
