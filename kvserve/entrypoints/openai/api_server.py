"""``kvserve serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over one ``AsyncLLM``.

Routes: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with
``"stream": true``), ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes); the OpenAPI schema at
``/openapi.json``; with the dashboard on, ``GET /dashboard`` and ``GET /v1/engine/state`` (``dashboard.py``, left
out of the schema). Every ``GET`` route answers ``HEAD`` too. Every error is
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (bad JSON, unknown model, invalid or
unsupported parameter, prompt too long), 401 for a missing or wrong API key, 404 for an unknown route, 405 for a
wrong method, 503 while shutting down; 500 only for a server bug.

API keys (``--api-key`` or ``KVSERVE_API_KEY``): ``APIKeyMiddleware`` wraps the whole app, so every route — those
added later included — needs ``Authorization: Bearer <key>``, except ``/health`` (and ``/metrics`` with
``--no-metrics-auth``). The dashboard's data (``/v1/engine/state``) needs it too; the page sends the key it reads
from ``/dashboard#key=...``.

SIGINT / SIGTERM: stop accepting connections, abort in-flight requests (a stream ends with an error event, a
pending JSON response is a 503), free their KV blocks, stop the engine loop, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai import dashboard as dash
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from kvserve.entrypoints.openai.serving import OpenAIError, OpenAIServing

logger = logging.getLogger(__name__)

_ERRORS = {400: {"model": p.ErrorResponse, "description": "bad input"},
           503: {"model": p.ErrorResponse, "description": "shutting down"}}
API_KEY_ENV = "KVSERVE_API_KEY"


class ErrorJSONResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote client text, which can hold a lone surrogate (valid in
    JSON, not encodable as UTF-8); escaped, it can never turn a 400 into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: "OpenAIError", headers: Optional[dict] = None) -> ErrorJSONResponse:
    return ErrorJSONResponse(e.body(), status_code=e.status, headers=headers)


class APIKeyMiddleware:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <api_key>`` unless its path is in
    ``exempt``; otherwise a 401 with OpenAI's error body (``code: invalid_api_key``). The SHA-256 digests of the
    sent and the expected key are compared with ``hmac.compare_digest``: the time depends neither on where they
    differ nor on the key's length. Pure ASGI (no request wrapping), so streaming and disconnect detection are
    untouched.

    Args:
        app: the ASGI app.
        api_key: the key clients must send.
        exempt: paths served without a key (``/health``; ``/metrics`` with ``--no-metrics-auth``).
    """

    def __init__(self, app, api_key: str, exempt: frozenset):
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        self.exempt = exempt

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        given = any(k == b"authorization" for k, _ in scope["headers"])
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer KEY).")
        err = OpenAIError(message, status=401, type="invalid_request_error", code="invalid_api_key")
        await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        # compare even when the scheme is wrong, so the time does not tell which part failed
        digest = hashlib.sha256(token.strip()).digest()
        return bool(hmac.compare_digest(digest, self.key_digest) & (scheme.lower() == b"bearer"))
_STREAM_DOC = {"description": "JSON, or with stream=true server-sent events (data: {chunk} ... data: [DONE])",
               "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def freeze_gc_heap() -> int:
    """Collect once, then move every object alive now (the modules, the model, the tokenizer, the app: ~245,000
    on the default model) into the collector's permanent generation (``gc.freeze``), as vLLM's engine does after
    start-up. A full collection then scans only what serving created: on a 2-vCPU Xeon one took 150 ms before and
    under 0.1 ms after (docs/server_benchmarks.md, "Garbage collection"), a pause that held the engine thread too
    (it needs the GIL between its C calls). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_app(llm: AsyncLLM, served_model_name: str, stat_logger: Optional[PrometheusStatLogger] = None,
              api_key: Optional[str] = None, metrics_auth: bool = True,
              dashboard: bool = False, dashboard_show_prompts: bool = False) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``llm`` and shuts it down.

    Args:
        llm: the async engine (``stat_logger`` should already be attached to it as ``llm.stat_logger``).
        served_model_name: the model id clients must use (or omit).
        stat_logger: what ``/metrics`` exposes; default ``llm.stat_logger``.
        api_key: if set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
        metrics_auth: with ``api_key``, whether ``/metrics`` needs it too (default yes).
        dashboard: add ``/dashboard`` and ``/v1/engine/state`` (``kvserve.entrypoints.openai.dashboard``).
        dashboard_show_prompts: the dashboard shows prompt text (else ids and token counts only).
    """
    stat_logger = stat_logger or llm.stat_logger

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        freeze_gc_heap()
        yield
        await llm.shutdown()
        gc.unfreeze()  # a process that builds another app (tests) gets its old objects collectable again

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions over the kvserve engine.")
    serving = OpenAIServing(llm, served_model_name)
    app.state.served_model_name = served_model_name
    if api_key is not None:
        exempt = {"/health"} | (set() if metrics_auth else {"/metrics"}) | (dash.page_paths() if dashboard else set())
        app.add_middleware(APIKeyMiddleware, api_key=api_key, exempt=frozenset(exempt))

    def get(path: str, **kw):
        """``@app.get`` that answers ``HEAD`` as well (same handler; the server sends no body)."""
        def register(fn):
            app.head(path, include_in_schema=False)(fn)
            return app.get(path, **kw)(fn)
        return register

    # -------------------------------------------------------------------------------------------- errors
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e, request.headers.get("content-type")))

    @app.exception_handler(ValidationError)
    async def _model_validation_error(request: Request, e: ValidationError):  # a body validated in a handler
        err = validation_error(RequestValidationError(e.errors()), request.headers.get("content-type"))
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{e.detail}: {request.method} {request.url.path}"
        return error_response(OpenAIError(message, status=e.status_code, type=kind), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = OpenAIError(f"internal server error: {type(e).__name__}", status=500, type="internal_server_error")
        return error_response(err)

    # -------------------------------------------------------------------------------------------- routes
    @get("/health", responses={503: _ERRORS[503]})
    async def health():
        """200 while the engine loop runs and accepts requests, else 503."""
        if llm.is_running:
            return {"status": "ok"}
        raise OpenAIError("the engine is not running", status=503, type="server_shutdown")

    @get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus text format (see ``kvserve.entrypoints.openai.metrics``)."""
        return Response(stat_logger.exposition() if stat_logger else b"", media_type=CONTENT_TYPE_LATEST)

    def card() -> p.ModelCard:
        return p.ModelCard(id=served_model_name, max_model_len=llm.max_model_len)

    @get("/version", response_model=p.VersionResponse)
    async def version():
        """The kvserve version."""
        return p.VersionResponse(version=kvserve.__version__)

    @get("/v1/models", response_model=p.ModelList)
    async def list_models():
        return p.ModelList(data=[card()])

    @get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: {"model": p.ErrorResponse}})
    async def get_model(model_id: str):
        if model_id != served_model_name:
            raise OpenAIError(f"The model {model_id!r} does not exist", param="model", status=404,
                              type="not_found_error", code="model_not_found")
        return card()

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses={200: _STREAM_DOC, **_ERRORS})
    async def completions(body: p.CompletionRequest, request: Request):
        return _to_response(await serving.create_completion(body, request.receive))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              responses={200: _STREAM_DOC, **_ERRORS})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return _to_response(await serving.create_chat_completion(body, request.receive))

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: dict = Body(..., description="a TokenizeCompletionRequest {prompt, add_special_tokens, "
                                                           "return_token_strs} or a TokenizeChatRequest {messages, "
                                                           "add_generation_prompt, continue_final_message, "
                                                           "add_special_tokens, return_token_strs}")):
        """Token ids of a prompt, or of a conversation under the chat template (vLLM's shapes)."""
        return _to_response(await serving.tokenize(body))

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: p.DetokenizeRequest):
        """The text of token ids."""
        return _to_response(await serving.detokenize(body))

    def openapi() -> dict:
        # FastAPI documents validation failures as 422; this server answers them with 400 (OpenAI's way)
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    if dashboard:
        dash.mount_dashboard(app, llm, served_model_name, show_prompts=dashboard_show_prompts)
    return app


def _to_response(result):
    if result is None:  # the client is gone; nothing will read this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


_UNION_HINTS = {  # by the field's last name
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {'role': str, 'content': str or a list of text parts} objects",
    "content": "a string or a list of {'type': 'text', 'text': str} parts (null only in an assistant message)",
}
_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def field_path(loc) -> str:
    """pydantic's error location as the field path kvserve's messages use (``messages[0].content``,
    ``tools[0].function.name``), cut before the first union-member tag (``str``, ``list[ContentPart]``, ...)."""
    path = ""
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x in _SCALAR_TAGS or not str(x).isidentifier():
            break
        else:
            path += f".{x}" if path else str(x)
    return path


def validation_error(e: RequestValidationError, content_type: Optional[str] = None) -> OpenAIError:
    """One 400 ``OpenAIError`` from pydantic's errors: the first offending top-level field as ``param``; a body
    that is not a JSON object sent without ``Content-Type: application/json`` says so."""
    errors = e.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    kind = first.get("type")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    media = (content_type or "").split(";")[0].strip().lower()
    hint = "" if media == "application/json" or media.endswith("+json") else (
        f"; send a JSON object with the header Content-Type: application/json (this request has "
        f"{'no Content-Type' if not media else 'Content-Type: ' + media})")
    if kind == "json_invalid":
        return OpenAIError(f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}{hint}",
                           code="json_invalid")
    if kind == "string_unicode":  # a lone surrogate where pydantic needs a real string (an object key)
        return OpenAIError("the request body holds a string that is not valid Unicode text (a lone surrogate)",
                           param=str(loc[0]) if loc else None)
    if not loc:
        return OpenAIError(f"the request body must be a JSON object ({first.get('msg')}){hint}")
    param = field_path(loc)
    if kind == "extra_forbidden":
        return OpenAIError(f"unrecognized request argument: {param}", param=param, code="unrecognized_argument")
    if kind == "missing":
        return OpenAIError(f"{param}: a required field is missing", param=param)
    same_field = [err for err in errors if field_path([x for x in err.get("loc", ()) if x != "body"]) == param]
    leaf = param.rsplit(".", 1)[-1].split("[")[0]
    if len(same_field) > 1 and leaf in _UNION_HINTS:
        return OpenAIError(f"{param} must be {_UNION_HINTS[leaf]}", param=param)
    return OpenAIError(f"{param}: {first.get('msg')}", param=param)


# ------------------------------------------------------------------------------------------------ the process
class KVServeServer(uvicorn.Server):
    """uvicorn's server with kvserve's shutdown: on SIGINT / SIGTERM (or ``should_exit``), abort in-flight requests
    before waiting for connections to close, and return normally (exit code 0; uvicorn would re-raise the signal).
    ``sock``: a socket bound before the model loaded (``bind_socket``), served on by ``serve()``.
    """

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, sock: Optional[socket.socket] = None):
        super().__init__(config)
        self.llm = llm
        self.sock = sock

    async def serve(self, sockets=None) -> None:
        """Serve on ``sockets``, else on the socket given at construction, else on ``config.host:port``."""
        await super().serve(sockets=sockets or ([self.sock] if self.sock is not None else None))

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn announces only the sockets it binds itself
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait any more
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.llm.abort_all()
        await super().shutdown(sockets)

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``); valid once ``started``."""
        return self.servers[0].sockets[0].getsockname()[1]


def build_server(engine_args: dict, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: Optional[str] = None, log_level: str = "info",
                 access_log: bool = True, api_key: Optional[str] = None, metrics_auth: bool = True,
                 sock: Optional[socket.socket] = None, dashboard: Optional[bool] = None,
                 dashboard_show_prompts: bool = False) -> KVServeServer:
    """Load the model and build the server (not started). ``served_model_name`` defaults to the model file's stem;
    ``dashboard`` (``/dashboard`` and ``/v1/engine/state``) defaults to on iff ``host`` is a loopback address.

    Args:
        api_key, metrics_auth: see ``build_app``.
        sock: an already bound socket (``bind_socket``) to serve on; ``host`` and ``port`` then only name it.

    Raises:
        ValueError: bad engine arguments or an unloadable model.
    """
    llm = AsyncLLM.from_engine_args(**engine_args)
    name = served_model_name or Path(llm.engine.model_path).stem
    llm.stat_logger = PrometheusStatLogger(name)
    if dashboard is None:
        dashboard = dash.is_loopback(host)
    app = build_app(llm, name, api_key=api_key, metrics_auth=metrics_auth, dashboard=dashboard,
                    dashboard_show_prompts=dashboard_show_prompts)
    if dashboard:
        logger.info("dashboard on: /dashboard (prompt text %s)", "shown" if dashboard_show_prompts else "hidden")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=5, timeout_graceful_shutdown=30)
    return KVServeServer(config, llm, sock)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), before the model loads, so a port
    in use is reported at once.

    Raises:
        ValueError: the address cannot be bound (in use, not local, permission denied).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        busy = " (another server is using it)" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}{busy}") from None
    sock.set_inheritable(True)
    return sock


def api_key_from(args: argparse.Namespace) -> Optional[str]:
    """``--api-key``, else ``$KVSERVE_API_KEY`` (empty = not set), else ``None`` (no authentication).

    Raises:
        ValueError: ``--api-key ""``.
    """
    if args.api_key is not None:
        if not args.api_key:
            raise ValueError("--api-key must not be empty")
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def add_args(parser: argparse.ArgumentParser) -> None:
    """``kvserve serve`` options (the engine options are added by the CLI)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: model file stem)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: "
                             f"${API_KEY_ENV} if set, else no authentication)")
    parser.add_argument("--no-metrics-auth", action="store_true",
                        help="with an API key, serve /metrics without it (for a Prometheus scraper)")
    dash.add_args(parser)


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """Serve until SIGINT / SIGTERM; returns 0 after a clean shutdown.

    Raises:
        ValueError: the address cannot be bound (checked before the model loads), an empty ``--api-key``, bad engine
            arguments.
    """
    api_key = api_key_from(args)
    sock = bind_socket(args.host, args.port)
    try:
        server = build_server(engine_args, host=args.host, port=args.port, served_model_name=args.served_model_name,
                              log_level=args.uvicorn_log_level, access_log=not args.no_access_log, api_key=api_key,
                              metrics_auth=not args.no_metrics_auth, sock=sock, dashboard=args.dashboard,
                              dashboard_show_prompts=args.dashboard_show_prompts)
    except BaseException:
        sock.close()
        raise
    asyncio.run(server.serve())
    return 0
