"""Anthropic's routes (``router``, included by ``api_server.build_app``): ``POST /v1/messages`` (JSON, or SSE with
``"stream": true``) and ``POST /v1/messages/count_tokens``. Their errors take Anthropic's shape
(``errors.error_response`` by path); the API key may come as ``x-api-key``. The handlers use
``request.app.state.anthropic_serving_messages``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.entrypoints.anthropic.serving_messages import CountTokensRequest, MessagesRequest
from kvserve.entrypoints.openai.routes import _check_accepting, _to_response

router = APIRouter()

_ERROR = {"description": "Anthropic's error shape", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"type": {"type": "string"}, "error": {"type": "object"}}}}}}


@router.post("/v1/messages", responses={200: {"description": "the message, or with stream=true Anthropic's "
                                                             "server-sent events",
                                              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                                        400: _ERROR, 404: _ERROR, 503: _ERROR})
async def create_message(body: MessagesRequest, request: Request):
    """Anthropic's Messages API (``serving_messages``)."""
    _check_accepting(request)
    return _to_response(await request.app.state.anthropic_serving_messages.create_message(body, request.receive))


@router.post("/v1/messages/count_tokens", responses={400: _ERROR, 404: _ERROR})
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt tokens a ``/v1/messages`` request with these fields would run."""
    return _to_response(await request.app.state.anthropic_serving_messages.count_tokens(body))
