"""``kvserve serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over one ``AsyncLLM``.

Routes: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with ``"stream": true``); the OpenAPI schema
at ``/openapi.json``; with the dashboard on, ``GET /dashboard`` and ``GET /v1/engine/state`` (``dashboard.py``, left
out of the schema). Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (bad
JSON, unknown model, invalid or unsupported parameter, prompt too long), 404 for an unknown route, 405 for a wrong
method, 503 while shutting down; 500 only for a server bug.

SIGINT / SIGTERM: stop accepting connections, abort in-flight requests (a stream ends with an error event, a
pending JSON response is a 503), free their KV blocks, stop the engine loop, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai import dashboard as dash
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from kvserve.entrypoints.openai.serving import OpenAIError, OpenAIServing

logger = logging.getLogger(__name__)

_ERRORS = {400: {"model": p.ErrorResponse, "description": "bad input"},
           503: {"model": p.ErrorResponse, "description": "shutting down"}}
_STREAM_DOC = {"description": "JSON, or with stream=true server-sent events (data: {chunk} ... data: [DONE])",
               "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def build_app(llm: AsyncLLM, served_model_name: str, stat_logger: Optional[PrometheusStatLogger] = None,
              dashboard: bool = False, dashboard_show_prompts: bool = False) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``llm`` and shuts it down.

    Args:
        llm: the async engine (``stat_logger`` should already be attached to it as ``llm.stat_logger``).
        served_model_name: the model id clients must use (or omit).
        stat_logger: what ``/metrics`` exposes; default ``llm.stat_logger``.
        dashboard: add ``/dashboard`` and ``/v1/engine/state`` (``kvserve.entrypoints.openai.dashboard``).
        dashboard_show_prompts: the dashboard shows prompt text (else ids and token counts only).
    """
    stat_logger = stat_logger or llm.stat_logger

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        yield
        await llm.shutdown()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions over the kvserve engine.")
    serving = OpenAIServing(llm, served_model_name)
    app.state.served_model_name = served_model_name

    # -------------------------------------------------------------------------------------------- errors
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(validation_error(e).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{e.detail}: {request.method} {request.url.path}"
        return JSONResponse(OpenAIError(message, status=e.status_code, type=kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = OpenAIError(f"internal server error: {type(e).__name__}", status=500, type="internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    # -------------------------------------------------------------------------------------------- routes
    @app.get("/health", responses={503: _ERRORS[503]})
    async def health():
        """200 while the engine loop runs and accepts requests, else 503."""
        if llm.is_running:
            return {"status": "ok"}
        raise OpenAIError("the engine is not running", status=503, type="server_shutdown")

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus text format (see ``kvserve.entrypoints.openai.metrics``)."""
        return Response(stat_logger.exposition() if stat_logger else b"", media_type=CONTENT_TYPE_LATEST)

    def card() -> p.ModelCard:
        return p.ModelCard(id=served_model_name, max_model_len=llm.max_model_len)

    @app.get("/v1/models", response_model=p.ModelList)
    async def list_models():
        return p.ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: {"model": p.ErrorResponse}})
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
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {'role': str, 'content': str or a list of text parts} objects",
}


def validation_error(e: RequestValidationError) -> OpenAIError:
    """One 400 ``OpenAIError`` from pydantic's errors: the first offending top-level field as ``param``."""
    errors = e.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    kind = first.get("type")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        return OpenAIError(f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           code="json_invalid")
    if not loc:
        return OpenAIError(f"the request body must be a JSON object ({first.get('msg')})")
    param = str(loc[0])
    if kind == "extra_forbidden":
        return OpenAIError(f"unrecognized request argument: {'.'.join(map(str, loc))}", param=param,
                           code="unrecognized_argument")
    if kind == "missing":
        return OpenAIError(f"{'.'.join(map(str, loc))}: a required field is missing", param=param)
    same_field = [err for err in errors if [x for x in err.get("loc", ()) if x != "body"][:1] == loc[:1]]
    if len(same_field) > 1 and param in _UNION_HINTS:
        return OpenAIError(f"{param} must be {_UNION_HINTS[param]}", param=param)
    return OpenAIError(f"{'.'.join(map(str, loc))}: {first.get('msg')}", param=param)


# ------------------------------------------------------------------------------------------------ the process
class KVServeServer(uvicorn.Server):
    """uvicorn's server with kvserve's shutdown: on SIGINT / SIGTERM (or ``should_exit``), abort in-flight requests
    before waiting for connections to close, and return normally (exit code 0; uvicorn would re-raise the signal).
    """

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM):
        super().__init__(config)
        self.llm = llm

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
                 access_log: bool = True, dashboard: Optional[bool] = None,
                 dashboard_show_prompts: bool = False) -> KVServeServer:
    """Load the model and build the server (not started). ``served_model_name`` defaults to the model file's stem;
    ``dashboard`` (``/dashboard`` and ``/v1/engine/state``) defaults to on iff ``host`` is a loopback address.

    Raises:
        ValueError: bad engine arguments or an unloadable model.
    """
    llm = AsyncLLM.from_engine_args(**engine_args)
    name = served_model_name or Path(llm.engine.model_path).stem
    llm.stat_logger = PrometheusStatLogger(name)
    if dashboard is None:
        dashboard = dash.is_loopback(host)
    app = build_app(llm, name, dashboard=dashboard, dashboard_show_prompts=dashboard_show_prompts)
    if dashboard:
        logger.info("dashboard on: /dashboard (prompt text %s)", "shown" if dashboard_show_prompts else "hidden")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=5, timeout_graceful_shutdown=30)
    return KVServeServer(config, llm)


def add_args(parser: argparse.ArgumentParser) -> None:
    """``kvserve serve`` options (the engine options are added by the CLI)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: model file stem)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    dash.add_args(parser)


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """Serve until SIGINT / SIGTERM; returns 0 after a clean shutdown."""
    server = build_server(engine_args, host=args.host, port=args.port, served_model_name=args.served_model_name,
                          log_level=args.uvicorn_log_level, access_log=not args.no_access_log,
                          dashboard=args.dashboard, dashboard_show_prompts=args.dashboard_show_prompts)
    asyncio.run(server.serve())
    return 0
