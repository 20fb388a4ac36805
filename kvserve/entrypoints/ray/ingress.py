"""The ingress of ``kvserve serve --data-parallel-size N``: ``kvserve serve``'s own FastAPI app and uvicorn server
over ``RayEngineClient`` (an ``EngineClient`` that forwards generation to the Ray Serve replicas of
``replica.KVServeReplica``, chosen by ``router.KVServeRequestRouter``), and the start-up of Ray and the deployment
(``deploy``, ``build_server``, ``run``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Optional

import ray
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RequestCancelledError
from starlette.middleware import Middleware

import kvserve
from kvserve.config import EngineConfig
from kvserve.distributed.router import ROUTERS
from kvserve.engine.protocol import EngineDeadError, EngineShutdownError, ModelInfo, EngineClientBase
from kvserve.entrypoints.openai.api_server import KVServeServer, api_key_from, bind_socket, build_app
from kvserve.entrypoints.openai.responses_store import StoreLimits
from kvserve.entrypoints.openai.serving_options import ServingOptions
from kvserve.entrypoints.ray.replica import ACCEPTED, APP_NAME, DEPLOYMENT_NAME, MAX_ATTEMPTS, KVServeReplica
from kvserve.entrypoints.ray.router import KVServeRequestRouter, get_router
from kvserve.structured.backend import GrammarBackend

logger = logging.getLogger(__name__)


class RemoteStream:
    """The outputs of one request served by a replica: ``RequestStream``'s interface (async iterator of
    ``RequestOutput``, ``abort()``). A replica that dies mid-request ends the iteration with
    ``EngineShutdownError`` (the server's 503)."""

    def __init__(self, request_id: str, response, owner: "RayEngineClient"):
        self.request_id = request_id
        self.finished = False
        self._response = response
        self._owner = owner

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._response.__anext__()
        except StopAsyncIteration:
            self._done()
            raise
        except BaseException as e:
            self._done()
            raise remote_error(e, self.request_id) from None
        if out.finished:
            self._done()
        return out

    def _done(self) -> None:
        self.finished = True
        self._owner._streams.pop(self.request_id, None)

    def abort(self) -> None:
        """Cancel the request on its replica (which aborts it and frees its blocks); idempotent."""
        if not self.finished:
            self._done()
            self._response.cancel()


def remote_error(e: BaseException, request_id: str) -> BaseException:
    """The ``AsyncLLM`` error for a failure of a replica call: its own error (``ValueError``,
    ``EngineShutdownError``, ``EngineDeadError``) unwrapped from Ray's ``RayTaskError``; a dead or unreachable replica
    -> ``EngineShutdownError`` (503); a cancelled call -> ``EngineShutdownError``; anything else -> ``EngineDeadError``
    (500)."""
    cause = e.cause if isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None else e
    if isinstance(cause, (ValueError, EngineShutdownError, EngineDeadError)):
        return type(cause)(str(cause))
    if isinstance(cause, (RayActorError, RequestCancelledError, asyncio.CancelledError)):
        return EngineShutdownError(f"request {request_id} aborted: its replica is gone ({type(cause).__name__})")
    return EngineDeadError(f"replica call failed: {cause!r}")


class RayEngineClient(EngineClientBase):
    """The ``EngineClient`` (``kvserve.engine.protocol``) of the ingress: the tokenizer side (``EngineClientBase``:
    tokenize, chat templates, structured-output checks) here, generation forwarded to the replicas through
    ``handle``.

    Args:
        handle: the ``KVServeReplica`` deployment's handle.
        config: the replicas' ``EngineConfig``.
        info: one replica's ``KVServeReplica.info()`` (its tokenizer, model facts and chat template).
    """

    def __init__(self, handle, config: EngineConfig, info: dict):
        tokenizer = info["tokenizer"]
        model_info = ModelInfo(model_path=info["model_path"], max_model_len=info["max_model_len"],
                               vocab_size=info["vocab_size"], eos_token_ids=tuple(info["eos_token_ids"]),
                               has_chat_template=bool(info["chat_template"] or info["chat_format"] == "harmony"
                                                      or getattr(tokenizer, "chat_template", None)),
                               scheduling_policy=config.scheduler_config.scheduling_policy,
                               chat_format=info["chat_format"])
        grammar = GrammarBackend(tokenizer, model_info.vocab_size, model_info.eos_token_ids)
        super().__init__(tokenizer, model_info, info["chat_template"], grammar)
        self.handle = handle
        self.stat_logger = ReplicaMetrics(handle)
        self.state_observer = None
        self._streams: dict = {}
        self._ids = itertools.count()
        self._running = False
        self.dead_error = None  # a replica's failure fails its requests only

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._running = True

    async def shutdown(self) -> None:
        """Refuse new requests and cancel every in-flight one on its replica."""
        self._running = False
        self.abort_all()

    def drain(self) -> None:
        """Refuse new requests; those in flight run on."""
        self._running = False

    def abort_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()

    def wake(self) -> None:
        """No engine loop here (``AsyncLLM``'s interface)."""

    async def add_request(self, prompt, sampling_params, request_id: Optional[str] = None,
                          arrival_time: Optional[float] = None, priority: int = 0) -> RemoteStream:
        """Send the request to a replica chosen by the router; return once the replica has queued it. A replica
        that dies before that is replaced by another (``MAX_ATTEMPTS`` tries in all).

        Raises:
            ValueError: the prompt or the request is rejected (as ``AsyncLLM.add_request``).
            EngineShutdownError: shutting down, or no replica accepted the request.
            EngineDeadError: a replica failed otherwise.
        """
        if not self._running:
            raise EngineShutdownError("the server is shutting down")
        rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        ids = await self.tokenize(prompt)
        last: BaseException = EngineShutdownError("no replica")
        for _ in range(MAX_ATTEMPTS):
            response = self.handle.options(stream=True).generate.remote(ids, sampling_params, rid, priority)
            try:
                first = await response.__anext__()
            except asyncio.CancelledError:
                response.cancel()
                raise
            except BaseException as e:
                last = remote_error(e, rid)
                if isinstance(last, EngineShutdownError) and self._running:
                    logger.warning("request %s: replica gone before accepting it; retrying", rid)
                    continue
                raise last from None
            assert first == ACCEPTED, first
            stream = RemoteStream(rid, response, self)
            self._streams[rid] = stream
            return stream
        raise last

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()


class ReplicaMetrics:
    """``/metrics`` of the deployment: every replica's series with a ``replica`` label (its Serve unique id).
    ``refresh()`` (awaited by ``MetricsRefresh`` before each scrape) fetches them; ``exposition()`` renders the last
    fetch."""

    def __init__(self, handle):
        self.handle = handle
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._texts: dict = {}

    async def refresh(self) -> None:
        router = get_router()
        ids = router.replica_ids() if router is not None else []
        texts = await asyncio.gather(*(self.handle.metrics.remote(replica=uid) for uid in ids),
                                     return_exceptions=True)
        self._texts = {uid: t for uid, t in zip(ids, texts) if isinstance(t, bytes)}

    def collect(self):
        families: dict = {}
        for uid, text in sorted(self._texts.items()):
            for fam in text_string_to_metric_families(text.decode()):
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": uid}, s.value, s.timestamp)
        return list(families.values())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsRefresh:
    """ASGI middleware (innermost, so the API key check still comes first): refresh ``metrics`` before ``GET
    /metrics`` reaches the app's handler."""

    def __init__(self, app, metrics: ReplicaMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await self.metrics.refresh()
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------------- start-up
def worker_env() -> dict:
    """Environment for Ray's worker processes: this ``kvserve`` first on ``PYTHONPATH`` (the checkout the driver
    imports), and the driver's ``KVSERVE_*`` and ``OMP_NUM_THREADS`` variables."""
    env = {k: v for k, v in os.environ.items() if k.startswith("KVSERVE_") or k == "OMP_NUM_THREADS"}
    root = str(Path(kvserve.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def deploy(engine_args: dict, num_replicas: int, router: str = "prefix", model_name: str = "kvserve",
           ray_address: Optional[str] = None, autoscaling: Optional[dict] = None, **router_kwargs):
    """Start (or join) Ray and run the ``KVServeReplica`` deployment; returns its ``DeploymentHandle``.

    Args:
        engine_args: every replica's engine arguments (``num_threads`` defaults to 1: one CPU per replica).
        num_replicas: replicas (>= 1).
        router: ``prefix``, ``least-loaded`` or ``round-robin``.
        ray_address: an existing cluster (``ray start --head``); default a local one with
            ``max(num_replicas, cpu count)`` CPUs.
        autoscaling: Serve's ``autoscaling_config`` instead of a fixed ``num_replicas``.
        router_kwargs: ``PrefixAwareRouter`` bounds (``balance_abs``, ``balance_rel``, ...).

    Raises:
        ValueError: bad replica count or router.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {num_replicas!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    engine_args = {"num_threads": 1, **{k: v for k, v in engine_args.items() if v is not None}}
    config = EngineConfig.from_kwargs(**engine_args)
    if not ray.is_initialized():
        kw = dict(address=ray_address) if ray_address else dict(num_cpus=max(num_replicas, os.cpu_count() or 1))
        ray.init(include_dashboard=False, runtime_env={"env_vars": worker_env()}, logging_level=logging.WARNING,
                 **kw)
    serve.start(proxy_location="Disabled")
    router_config = RequestRouterConfig(
        request_router_class=KVServeRequestRouter, request_routing_stats_period_s=1.0,
        request_router_kwargs={"router": router, "block_size": config.cache_config.block_size,
                               "deployment": DEPLOYMENT_NAME, **router_kwargs})
    options = dict(autoscaling_config=autoscaling) if autoscaling else dict(num_replicas=num_replicas)
    dep = serve.deployment(KVServeReplica, name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 1},
                           max_ongoing_requests=1024, request_router_config=router_config,
                           health_check_period_s=2, graceful_shutdown_timeout_s=5, **options)
    return serve.run(dep.bind(engine_args, model_name), name=APP_NAME, route_prefix=None)


def build_client(handle, engine_args: dict) -> RayEngineClient:
    """The ingress's engine client; the tokenizer and the model's facts come from a replica (no weights here)."""
    config = EngineConfig.from_kwargs(**{k: v for k, v in engine_args.items() if v is not None})
    info = handle.info.remote().result()
    return RayEngineClient(handle, config, info)


def build_server(engine_args: dict, num_replicas: int, router: str = "prefix", host: str = "127.0.0.1",
                 port: int = 8000, served_model_name: Optional[str] = None, log_level: str = "info",
                 access_log: bool = True, api_key: Optional[str] = None, metrics_auth: bool = True,
                 sock=None, ray_address: Optional[str] = None, autoscaling: Optional[dict] = None,
                 options: Optional[ServingOptions] = None, store_limits: Optional[StoreLimits] = None,
                 **router_kwargs) -> KVServeServer:
    """Deploy the replicas and build the ingress server (not started): ``api_server.build_app`` over a
    ``RayEngineClient``; ``/metrics`` per replica. Arguments as ``api_server.build_server`` and ``deploy``
    (``options``: parsers and CORS; ``--vllm-metric-names`` is not available behind Ray: a ``ValueError``;
    ``store_limits``: the ``/v1/responses`` store's bounds, one store at the ingress).

    Raises:
        ValueError: bad arguments (replica count, router, engine arguments).
    """
    if options is not None and options.vllm_metric_names:
        raise ValueError("--vllm-metric-names is not available with --data-parallel-size > 1")
    config = EngineConfig.from_kwargs(**{k: v for k, v in engine_args.items() if v is not None})
    name = served_model_name or Path(config.model_config.model or _default_model()).stem
    handle = deploy(engine_args, num_replicas, router, name, ray_address, autoscaling, **router_kwargs)
    client = build_client(handle, engine_args)
    app = build_app(client, name, stat_logger=client.stat_logger, api_key=api_key, metrics_auth=metrics_auth,
                    options=options, store_limits=store_limits)
    app.user_middleware.append(Middleware(MetricsRefresh, metrics=client.stat_logger))  # innermost
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=5, timeout_graceful_shutdown=30)
    return KVServeServer(config, client, sock)


def _default_model() -> str:
    from kvserve.model.loader import default_model_path

    return str(default_model_path())


#: Seconds ``shutdown_ray`` waits for Serve to stop before stopping Ray regardless.
SERVE_SHUTDOWN_TIMEOUT_S = 60.0


def shutdown_ray(timeout_s: float = SERVE_SHUTDOWN_TIMEOUT_S) -> None:
    """Delete the application and stop Serve, then Ray (a local cluster ends with it).

    ``serve.shutdown()`` can wait forever on a controller that is already gone: in one of six benchmark runs
    here it was still waiting 14 minutes after the replicas had stopped, with the raylet retrying
    ``ServeController.graceful_shutdown`` (Ray's open issue ray-project/ray#60748 is the same kind of hang). It runs in a
    daemon thread; after ``timeout_s`` seconds a warning is logged and Ray is stopped anyway."""
    import threading

    def stop_serve() -> None:
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001 -- Ray is stopped next either way
            logger.warning("serve.shutdown() failed: %s", e)

    t = threading.Thread(target=stop_serve, name="kvserve-serve-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning("Ray Serve did not stop within %.0f s; stopping Ray without it", timeout_s)
    ray.shutdown()


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """``kvserve serve --data-parallel-size N``: serve until SIGINT / SIGTERM, then stop Ray; returns 0.

    Raises:
        ValueError: as ``build_server``; ``--dashboard`` (not available with replicas; off by default here).
    """
    if args.dashboard:
        raise ValueError("--dashboard is not available with --data-parallel-size > 1")
    api_key = api_key_from(args)
    sock = bind_socket(args.host, args.port)
    try:
        server = build_server(engine_args, args.data_parallel_size, args.router, host=args.host, port=args.port,
                              served_model_name=args.served_model_name, log_level=args.uvicorn_log_level,
                              access_log=not args.no_access_log, api_key=api_key,
                              metrics_auth=not args.no_metrics_auth, sock=sock, ray_address=args.ray_address,
                              balance_abs=args.router_balance_abs, balance_rel=args.router_balance_rel,
                              options=ServingOptions.from_args(args), store_limits=StoreLimits.from_args(args))
        asyncio.run(server.serve())
    finally:
        sock.close()
        shutdown_ray()
    return 0
