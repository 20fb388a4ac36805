"""``kvserve serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over one ``AsyncLLM``: the app factory
(``build_app``), the server (``KVServeServer``, ``build_server``, ``bind_socket``) and the command (``add_args``,
``api_key_from``, ``run``).

The routes are ``routes.py``'s (OpenAI's and vLLM's shapes); the OpenAPI schema is at ``/openapi.json``; with the
dashboard on, ``GET /dashboard`` and ``GET /v1/engine/state`` (``kvserve.entrypoints.dashboard``, left out of the
schema). Every error is ``{"error": {"message", "type", "param", "code"}}`` (``errors.py``).

API keys (``--api-key`` or ``KVSERVE_API_KEY``): ``APIKeyMiddleware`` wraps the whole app, so every route — those
added later included — needs ``Authorization: Bearer <key>``, except ``/health`` (and ``/metrics`` with
``--no-metrics-auth``). The dashboard's data (``/v1/engine/state``) needs it too; the page sends the key it reads
from ``/dashboard#key=...``.

CORS (``--allowed-origins`` ...: ``serving_options``), off by default, sits outside the key check: a preflight passes
without the key, a real request still needs it.

SIGINT / SIGTERM: stop accepting connections, abort in-flight requests (a stream ends with an error event, a
pending JSON response is a 503), free their KV blocks, stop the engine loop, exit 0. With ``--shutdown-timeout``
the requests in flight first get up to that many seconds to finish while new ones get a 503 (``KVServeServer``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import gc
import hashlib
import hmac
import logging
import os
import signal
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from kvserve.engine.async_llm import AsyncLLM  # the composition root: build_server makes the client
from kvserve.engine.protocol import EngineClient
from kvserve.entrypoints.anthropic.routes import router as anthropic_router
from kvserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from kvserve.entrypoints.dashboard import hub as dash
from kvserve.entrypoints.openai import limits as request_limits
from kvserve.entrypoints.openai.errors import add_exception_handlers, error_response
from kvserve.entrypoints.openai.limits import RequestBodyMiddleware, RequestLimits
from kvserve.entrypoints.openai import responses_store
from kvserve.entrypoints.openai.metrics import HTTPMetrics, HTTPMetricsMiddleware, PrometheusStatLogger
from kvserve.entrypoints.openai.responses_store import ResponseStore, StoreLimits
from kvserve.entrypoints.openai.routes import router
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvserve.entrypoints.openai.serving_engine import OpenAIError
from kvserve.entrypoints.openai import serving_options
from kvserve.entrypoints.openai.serving_options import ServingOptions
from kvserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvserve.validation import check_number

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVSERVE_API_KEY"


class APIKeyMiddleware:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <api_key>`` (or ``x-api-key: <api_key>``,
    Anthropic's header) unless its path is in
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
        given = any(k in (b"authorization", b"x-api-key") for k, _ in scope["headers"])
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer KEY) "
                   "or an x-api-key header.")
        err = OpenAIError(message, status=401, type="invalid_request_error", code="invalid_api_key")
        await error_response(err, {"WWW-Authenticate": "Bearer"}, path=scope["path"])(scope, receive, send)

    def _authorized(self, scope) -> bool:
        """``Authorization: Bearer KEY``, or ``x-api-key: KEY`` (Anthropic's header, what its clients send)."""
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        x_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
        # compare both, and even when the scheme is wrong, so the time does not tell which part failed
        bearer = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key_digest)
        header = hmac.compare_digest(hashlib.sha256(x_key.strip()).digest(), self.key_digest)
        return bool((bearer & (scheme.lower() == b"bearer")) | (header & bool(x_key)))


def freeze_gc_heap() -> int:
    """Collect once, then move every object alive now (the modules, the model, the tokenizer, the app: ~245,000
    on the default model) into the collector's permanent generation (``gc.freeze``), as vLLM's engine does after
    start-up. A full collection then scans only what serving created: on a 2-vCPU Xeon one took 150 ms before and
    under 0.1 ms after (docs/performance.md, "Garbage collection"), a pause that held the engine thread too
    (it needs the GIL between its C calls). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_app(llm: EngineClient, served_model_name: str, stat_logger: Optional[PrometheusStatLogger] = None,
              api_key: Optional[str] = None, metrics_auth: bool = True,
              dashboard: bool = False, dashboard_show_prompts: bool = False,
              limits: Optional[RequestLimits] = None, options: Optional[ServingOptions] = None,
              store_limits: Optional[StoreLimits] = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``llm`` and shuts it down.

    Args:
        llm: the engine client (``AsyncLLM``, or the Ray ingress's; ``stat_logger`` should already be attached to
            it as ``llm.stat_logger``).
        served_model_name: the model id clients must use (or omit).
        stat_logger: what ``/metrics`` exposes; default ``llm.stat_logger``.
        api_key: if set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
        metrics_auth: with ``api_key``, whether ``/metrics`` needs it too (default yes).
        dashboard: add ``/dashboard`` and ``/v1/engine/state`` (``kvserve.entrypoints.dashboard``).
        dashboard_show_prompts: the dashboard shows prompt text (else ids and token counts only).
        limits: the request bounds (``limits.RequestLimits``; default its defaults); an unset ``max_prompt_chars``
            is derived from ``llm.max_model_len`` and the vocabulary's longest token.
        options: parsers, CORS and metric names (``serving_options.ServingOptions``; default: all off); its
            ``reasoning_parser`` splits reasoning from the answer in every API (chat ``reasoning_content``,
            Responses' reasoning items, Messages' thinking blocks).
        store_limits: the bounds of the ``/v1/responses`` store (``responses_store.StoreLimits``).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        freeze_gc_heap()
        yield
        await llm.shutdown()
        gc.unfreeze()  # a process that builds another app (tests) gets its old objects collectable again

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions, chat completions and responses, and Anthropic's "
                              "messages, over the kvserve engine.")
    vocab = llm.token_vocab  # shared: building one reads the whole vocabulary
    state = app.state
    state.engine_client = llm
    state.served_model_name = served_model_name
    state.stat_logger = stat_logger or llm.stat_logger
    limits = (limits or RequestLimits()).resolve(llm.max_model_len, request_limits.longest_token_chars(llm.tokenizer))
    state.limits = limits
    state.openai_serving_completion = OpenAIServingCompletion(llm, served_model_name, vocab, limits)
    options = options or ServingOptions()  # the tool-call format resolved once (logged), for every API
    chat_format = llm.model_info.chat_format
    options = dataclasses.replace(options, tool_call_parser=options.resolve_tool_parser(
        llm.chat_template_text(tools=[{}]), chat_format), forced_tool_format=options.tool_call_parser,
        reasoning_parser=options.resolve_reasoning_parser(chat_format))
    state.options = options
    state.openai_serving_chat = OpenAIServingChat(llm, served_model_name, vocab, limits, options)
    state.openai_serving_tokenization = OpenAIServingTokenization(llm, served_model_name, vocab, limits)
    state.openai_serving_responses = OpenAIServingResponses(llm, served_model_name, vocab, limits, options,
                                                            ResponseStore(store_limits))
    state.anthropic_serving_messages = AnthropicServingMessages(llm, served_model_name, vocab, limits, options)
    app.add_middleware(RequestBodyMiddleware, limits=limits)  # inside the key check: no body read without a key
    if api_key is not None:
        exempt = {"/health"} | (set() if metrics_auth else {"/metrics"}) | (dash.page_paths() if dashboard else set())
        app.add_middleware(APIKeyMiddleware, api_key=api_key, exempt=frozenset(exempt))
    if options.cors() is not None:  # outside the key check: a preflight needs no key, its 401s carry CORS headers
        app.add_middleware(CORSMiddleware, **options.cors())
    http_metrics = _http_metrics(state.stat_logger, served_model_name)
    if http_metrics is not None:  # outermost: counts the 401s and 413s of the checks inside it
        app.add_middleware(HTTPMetricsMiddleware, metrics=http_metrics, routes=app.routes)
    add_exception_handlers(app)
    app.include_router(router)
    app.include_router(anthropic_router)
    app.openapi = lambda: _openapi_schema(app)
    if dashboard:
        hub = dash.mount_dashboard(app, llm, served_model_name, show_prompts=dashboard_show_prompts)
        if http_metrics is not None:
            hub.http_totals = http_metrics.error_totals
    return app


def _http_metrics(stat_logger, model_name: str) -> Optional[HTTPMetrics]:
    """The ``HTTPMetrics`` in ``stat_logger``'s registry (made once per stat logger), or ``None`` without one."""
    registry = getattr(stat_logger, "registry", None)
    if registry is None:
        return None
    if getattr(stat_logger, "http_metrics", None) is None:
        stat_logger.http_metrics = HTTPMetrics(registry, model_name)
    return stat_logger.http_metrics


def _openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI schema, built once. FastAPI documents validation failures as 422; this server answers them
    with 400 (OpenAI's way), so the 422 responses are left out."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


# ------------------------------------------------------------------------------------------------ the process
class KVServeServer(uvicorn.Server):
    """uvicorn's server with kvserve's shutdown: on SIGINT / SIGTERM (or ``should_exit``), abort in-flight requests
    before waiting for connections to close, and return normally (exit code 0; uvicorn would re-raise the signal).

    With ``shutdown_timeout`` > 0 (vLLM's ``--shutdown-timeout``) the first signal drains instead: new generation
    requests get a 503 with ``Retry-After`` and ``/health`` a 503 (``AsyncLLM.drain``), the requests in flight run
    on, and the server shuts down as above once none is left or ``shutdown_timeout`` seconds have passed (those
    left are aborted). A second signal ends the drain at once (a third SIGINT: no more waiting at all).

    Args:
        config: uvicorn's configuration (the app).
        llm: the engine the app serves.
        sock: a socket bound before the model loaded (``bind_socket``), served on by ``serve()``.
        shutdown_timeout: seconds to drain after the first signal; 0 (default): abort at once.
    """

    def __init__(self, config: uvicorn.Config, llm: EngineClient, sock: Optional[socket.socket] = None,
                 shutdown_timeout: float = 0.0):
        super().__init__(config)
        self.llm = llm
        self.sock = sock
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: Optional[float] = None  # time.monotonic() when the drain ends, once it has begun

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
        """The signal handler (only sets flags: ``on_tick`` acts on them)."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait any more
        elif self.shutdown_timeout > 0 and self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
            self.llm.drain()
            logger.info("draining: no new requests; %d in flight may run for up to %g s", self.llm.num_streams,
                        self.shutdown_timeout)
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); while draining, shut down once nothing is in flight or time is up."""
        if self.drain_deadline is not None and not self.should_exit:
            left = self.llm.num_streams
            if left == 0 or time.monotonic() >= self.drain_deadline:
                if left:
                    logger.warning("drain: %g s passed, aborting the %d requests left", self.shutdown_timeout, left)
                self.should_exit = True
        return await super().on_tick(counter)

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
                 dashboard_show_prompts: bool = False, limits: Optional[RequestLimits] = None,
                 shutdown_timeout: float = 0.0, options: Optional[ServingOptions] = None,
                 store_limits: Optional[StoreLimits] = None) -> KVServeServer:
    """Load the model and build the server (not started). ``served_model_name`` defaults to the model file's stem;
    ``dashboard`` (``/dashboard`` and ``/v1/engine/state``) defaults to on iff ``host`` is a loopback address.

    Args:
        api_key, metrics_auth, limits, options, store_limits: see ``build_app``.
        shutdown_timeout: seconds in-flight requests may run on after SIGTERM / SIGINT (``KVServeServer``).
        sock: an already bound socket (``bind_socket``) to serve on; ``host`` and ``port`` then only name it.

    Raises:
        ValueError: bad engine arguments, an unloadable model or a negative ``shutdown_timeout`` (an unknown
            parser name is refused when ``ServingOptions`` is made, before the model loads).
    """
    check_number("shutdown_timeout", shutdown_timeout, 0, 24 * 3600)
    llm = AsyncLLM.from_engine_args(**engine_args)
    name = served_model_name or Path(llm.model_info.model_path).stem
    options = options or ServingOptions()
    llm.stat_logger = PrometheusStatLogger(name, vllm_metric_names=options.vllm_metric_names)
    if dashboard is None:
        dashboard = dash.is_loopback(host)
    app = build_app(llm, name, api_key=api_key, metrics_auth=metrics_auth, dashboard=dashboard,
                    dashboard_show_prompts=dashboard_show_prompts, limits=limits, options=options,
                    store_limits=store_limits)
    if dashboard:
        logger.info("dashboard on: /dashboard (prompt text %s)", "shown" if dashboard_show_prompts else "hidden")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=5, timeout_graceful_shutdown=30)
    return KVServeServer(config, llm, sock, shutdown_timeout=shutdown_timeout)


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
    parser.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="on SIGTERM / SIGINT, seconds to let requests in flight finish while new ones get 503 "
                             "and /health is not ready; then the rest are aborted (default: 0, abort at once, as "
                             "vLLM)")
    dash.add_args(parser)
    request_limits.add_args(parser)
    serving_options.add_args(parser)
    responses_store.add_args(parser)


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
                              dashboard_show_prompts=args.dashboard_show_prompts,
                              limits=RequestLimits.from_args(args), shutdown_timeout=args.shutdown_timeout,
                              options=ServingOptions.from_args(args), store_limits=StoreLimits.from_args(args))
    except BaseException:
        sock.close()
        raise
    asyncio.run(server.serve())
    return 0
