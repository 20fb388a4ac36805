"""The OpenAI-compatible routes (``router``, included by ``api_server.build_app``): ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /version``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON, or SSE with ``"stream": true``), ``POST /tokenize``, ``POST /detokenize``
(vLLM's shapes), ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel`` (OpenAI's Responses API). Every ``GET``
route answers ``HEAD`` too.

A handler finds what it serves with on ``request.app.state`` (set by ``build_app``): ``engine_client`` (the
``EngineClient``), ``served_model_name``, ``stat_logger``, ``openai_serving_completion``, ``openai_serving_chat``,
``openai_serving_tokenization`` and ``openai_serving_responses``.
"""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import kvserve
from kvserve.entrypoints.openai import protocol as p
from kvserve.engine.protocol import EngineShutdownError
from kvserve.entrypoints.openai.errors import AsciiJSONResponse
from kvserve.entrypoints.openai.serving_engine import OpenAIError, engine_error
from kvserve.entrypoints.openai.serving_responses import ResponsesRequest

router = APIRouter()

_ERRORS = {400: {"model": p.ErrorResponse, "description": "bad input"},
           503: {"model": p.ErrorResponse, "description": "shutting down"}}
_STREAM_DOC = {"description": "JSON, or with stream=true server-sent events (data: {chunk} ... data: [DONE])",
               "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def _get(path: str, **kw):
    """``@router.get`` that answers ``HEAD`` as well (same handler; the server sends no body)."""
    def register(fn):
        router.head(path, include_in_schema=False)(fn)
        return router.get(path, **kw)(fn)
    return register


def _card(request: Request) -> p.ModelCard:
    state = request.app.state
    return p.ModelCard(id=state.served_model_name, max_model_len=state.engine_client.max_model_len)


def _to_response(result):
    """A handler's answer: 499 when the client is gone, JSON for a model or a dict, else an SSE stream."""
    if result is None:  # the client is gone; nothing will read this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    if isinstance(result, dict):  # echoes client text (Responses: tools, metadata): ASCII-escaped
        return AsciiJSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@_get("/health", responses={503: _ERRORS[503]})
async def health(request: Request):
    """200 while the engine loop runs and accepts requests, else 503 saying why: the loop failed (its error), or
    the server drains (``--shutdown-timeout``: the requests in flight still run, none is accepted) or shuts down."""
    llm = request.app.state.engine_client
    if llm.is_running:
        return {"status": "ok"}
    dead = getattr(llm, "dead_error", None)
    if dead is not None:
        raise OpenAIError(f"the engine loop failed: {dead!r}", status=503, type="server_shutdown")
    n = llm.num_streams
    if n:
        raise OpenAIError(f"draining: finishing {n} in-flight request{'s' if n != 1 else ''}; not accepting new ones",
                          status=503, type="server_shutdown")
    raise OpenAIError("shutting down: no request in flight; not accepting new ones", status=503,
                      type="server_shutdown")


@_get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request):
    """Prometheus text format (see ``kvserve.entrypoints.openai.metrics``)."""
    stat_logger = request.app.state.stat_logger
    return Response(stat_logger.exposition() if stat_logger else b"", media_type=CONTENT_TYPE_LATEST)


@_get("/version", response_model=p.VersionResponse)
async def version():
    """The kvserve version."""
    return p.VersionResponse(version=kvserve.__version__)


@_get("/v1/models", response_model=p.ModelList)
async def list_models(request: Request):
    return p.ModelList(data=[_card(request)])


@_get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: {"model": p.ErrorResponse}})
async def get_model(model_id: str, request: Request):
    if model_id != request.app.state.served_model_name:
        raise OpenAIError(f"The model {model_id!r} does not exist", param="model", status=404,
                          type="not_found_error", code="model_not_found")
    return _card(request)


def _check_accepting(request: Request) -> None:
    """503 with ``Retry-After`` for a new generation request while the server drains or shuts down (before any
    work is done for it); a dead engine's requests fail later with its 500."""
    llm = request.app.state.engine_client
    if not llm.is_running and getattr(llm, "dead_error", None) is None:
        raise engine_error(EngineShutdownError("the server is shutting down: no new requests"))


@router.post("/v1/completions", response_model=p.CompletionResponse, responses={200: _STREAM_DOC, **_ERRORS})
async def completions(body: p.CompletionRequest, request: Request):
    _check_accepting(request)
    serving = request.app.state.openai_serving_completion
    return _to_response(await serving.create_completion(body, request.receive))


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses={200: _STREAM_DOC, **_ERRORS})
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    _check_accepting(request)
    serving = request.app.state.openai_serving_chat
    return _to_response(await serving.create_chat_completion(body, request.receive))


@router.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
async def tokenize(request: Request,
                   body: dict = Body(..., description="a TokenizeCompletionRequest {prompt, add_special_tokens, "
                                                      "return_token_strs} or a TokenizeChatRequest {messages, "
                                                      "add_generation_prompt, continue_final_message, "
                                                      "add_special_tokens, return_token_strs}")):
    """Token ids of a prompt, or of a conversation under the chat template (vLLM's shapes)."""
    return _to_response(await request.app.state.openai_serving_tokenization.tokenize(body))


@router.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: p.DetokenizeRequest, request: Request):
    """The text of token ids."""
    return _to_response(await request.app.state.openai_serving_tokenization.detokenize(body))


# ---------------------------------------------------------------------------------------------------- responses
@router.post("/v1/responses", responses={200: {"description": "the response object, or with stream=true typed "
                                                              "server-sent events (event: response.created ...)",
                                               "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                                         404: _ERRORS[400], **_ERRORS})
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API (``serving_responses``)."""
    _check_accepting(request)
    return _to_response(await request.app.state.openai_serving_responses.create_response(body, request.receive))


@_get("/v1/responses/{response_id}", responses={404: {"model": p.ErrorResponse}})
async def retrieve_response(response_id: str, request: Request):
    """A stored response (404 if unknown, deleted or expired)."""
    return AsciiJSONResponse(request.app.state.openai_serving_responses.retrieve(response_id))


@_get("/v1/responses/{response_id}/input_items", responses={400: _ERRORS[400], 404: {"model": p.ErrorResponse}})
async def list_input_items(response_id: str, request: Request,
                           limit: Optional[str] = Query(None, description="items per page, 1..100 (default 20)"),
                           order: Optional[str] = Query(None, description="asc, or desc (newest first, the default)"),
                           after: Optional[str] = Query(None, description="an item id: the page after it")):
    """A stored response's input items, OpenAI's list (query ``limit``, ``order``, ``after``; checked, with any
    other parameter, in ``responses_items.list_page``)."""
    query = dict(request.query_params)
    return AsciiJSONResponse(request.app.state.openai_serving_responses.input_items(response_id, query))


@router.delete("/v1/responses/{response_id}", responses={404: {"model": p.ErrorResponse}})
async def delete_response(response_id: str, request: Request):
    """Forget a stored response."""
    return AsciiJSONResponse(request.app.state.openai_serving_responses.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel", responses={404: {"model": p.ErrorResponse}, **_ERRORS})
async def cancel_response(response_id: str, request: Request):
    """Stop a response that is being generated."""
    return AsciiJSONResponse(request.app.state.openai_serving_responses.cancel(response_id))
