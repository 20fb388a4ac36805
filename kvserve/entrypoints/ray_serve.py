"""``kvserve serve --data-parallel-size N``: N kvserve engines as Ray Serve replicas behind one OpenAI server.

Layout (one Ray Serve application, no Ray HTTP proxy):

- ``KVServeReplica``: a Serve deployment of N replicas (1 CPU each); each owns one ``AsyncLLM`` and streams the
  ``RequestOutput``s of a request from ``generate`` (token ids in, validated ``SamplingParams``).
- ``KVServeRequestRouter``: the deployment's Ray Serve custom request router (``ray.serve.request_router``). It
  runs inside the ingress's ``DeploymentHandle`` and delegates the choice to ``kvserve.distributed.router``
  (``--router prefix|least-loaded|round-robin``), learning from every routed request's prompt block hashes. The load
  it sees per replica: the requests it has routed there and not yet seen complete (the ingress is the replica's
  only client, so that is the replica's running + waiting), and the KV usage the replica reports through Serve's
  ``record_routing_stats`` (every second).
- The ingress: the same FastAPI app and uvicorn server as ``kvserve serve`` (``api_server.build_app``; same routes,
  streaming, errors), over ``RayEngineClient``, which stands in for ``AsyncLLM``: prompts are tokenized and
  validated here, generation is forwarded to a replica through the handle. ``/metrics`` is every replica's metrics
  with a ``replica`` label (``ReplicaMetrics``, refreshed on each scrape).

Failures: a replica that dies before it accepted a request is retried on another replica (at most
``MAX_ATTEMPTS`` tries); once accepted, the request fails with 503 (``EngineShutdownError``: a JSON response is a 503,
a stream ends with an error event). Serve replaces the dead replica; the router forgets what it learned about it.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict, deque
from typing import Optional

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.distributed.router import ReplicaLoad, make_router, prompt_block_hashes
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.metrics import PrometheusStatLogger
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

APP_NAME = "kvserve"
DEPLOYMENT_NAME = "KVServeReplica"
MAX_ATTEMPTS = 3  # tries of a request whose replica died before accepting it
ACCEPTED = "accepted"  # the first item of every generate stream: the replica queued the request

_ROUTERS: dict = {}  # deployment name -> the KVServeRequestRouter in this process (created by the ingress's handle)


# ---------------------------------------------------------------------------------------------------- replica
class KVServeReplica:
    """One engine replica (a Ray Serve deployment class; see ``deploy``).

    Args:
        engine_args: ``LLMEngine.from_engine_args`` keywords.
        model_name: the ``model_name`` label of its metrics.
    """

    def __init__(self, engine_args: dict, model_name: str):
        self.stat_logger = PrometheusStatLogger(model_name)
        self.llm = AsyncLLM.from_engine_args(stat_logger=self.stat_logger, **engine_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, token_ids: list, sampling_params: SamplingParams, request_id: str, priority: int = 0,
                       replica: Optional[str] = None):
        """Yield ``ACCEPTED`` once the request is queued, then its ``RequestOutput``s (the last ``finished``).
        Cancelled (the client went away): the request is aborted and its blocks freed.

        Raises:
            ValueError: the engine rejected the request. EngineShutdownError, EngineDeadError: as ``AsyncLLM``.
        """
        await self.llm.start()
        stream = await self.llm.add_request(token_ids, sampling_params, request_id, priority=priority)
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def info(self, replica: Optional[str] = None) -> dict:
        """``replica_id``, ``max_model_len``, ``num_blocks``, ``block_size``, ``pid``, and the model's ``tokenizer``
        and ``arch`` (what the ingress needs to tokenize and validate, without loading the weights)."""
        await self.llm.start()
        e = self.llm.engine
        return {"replica_id": self.replica_id, "max_model_len": e.max_model_len, "num_blocks": e.num_blocks,
                "block_size": e.block_size, "pid": os.getpid(), "tokenizer": e.tokenizer, "arch": e.arch,
                "model_path": str(e.model_path)}

    async def metrics(self, replica: Optional[str] = None) -> bytes:
        """This replica's Prometheus text (``PrometheusStatLogger.exposition``)."""
        return self.stat_logger.exposition()

    def record_routing_stats(self) -> dict:
        """Serve's routing-stats hook: ``num_running``, ``num_waiting``, ``kv_usage`` (0..1), ``num_blocks`` (the
        pool's size, which bounds what its prefix cache can hold)."""
        e = self.llm.engine
        stats = e.kv_cache_stats()
        return {"num_running": e.scheduler.num_running, "num_waiting": e.scheduler.num_waiting,
                "kv_usage": stats.usage, "num_blocks": stats.num_blocks}

    def check_health(self) -> None:
        """Serve's health check: raises once the engine loop has failed (Serve then replaces the replica)."""
        if self.llm.dead_error is not None:
            raise RuntimeError(f"the engine loop failed: {self.llm.dead_error!r}")


# ---------------------------------------------------------------------------------------------------- router
class KVServeRequestRouter(RequestRouter):
    """Ray Serve request router over ``kvserve.distributed.router`` (configured by ``initialize_state``).

    ``generate`` calls are routed by the policy; a call with a ``replica=<unique id>`` keyword goes to that replica
    (the ingress's per-replica calls: metrics, info); other calls go to the least loaded replica.

    Attributes:
        decisions: the last ``(request_id, replica unique id, first block hash or None)`` routed (a bounded deque,
            newest last).
    """

    def initialize_state(self, router: str = "prefix", block_size: int = 16, deployment: str = DEPLOYMENT_NAME,
                         **prefix_kwargs) -> None:
        """Ray Serve calls this with ``RequestRouterConfig.request_router_kwargs``."""
        self.policy = make_router(router, **(prefix_kwargs if router == "prefix" else {}))
        self.auto_cache_blocks = router == "prefix" and "cache_blocks" not in prefix_kwargs
        self.block_size = block_size
        self.inflight: dict = defaultdict(int)  # replica unique id -> chosen or routed, not completed
        self._routed: dict = {}  # internal request id -> replica unique id (chosen, then in flight)
        self._hashes: dict = {}  # internal request id -> block hashes, between choose and routed
        self.decisions: deque = deque(maxlen=10000)
        # Serve may rebuild this class from a by-value pickle (its own copy of the module globals): register in
        # the imported module, where get_router looks
        from kvserve.entrypoints import ray_serve

        ray_serve._ROUTERS[deployment] = self

    def replica_ids(self) -> list[str]:
        """Unique ids of the replicas the router can send to now."""
        return sorted(r.unique_id for r in self.curr_replicas)

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        stats = r.routing_stats or {}
        return ReplicaLoad(num_running=self.inflight[r.replica_id.unique_id],
                           kv_usage=float(stats.get("kv_usage", 0.0)))

    def _size_prefix_cache(self, replicas) -> None:
        """Model each replica's prefix cache as large as its KV pool (the smallest reported ``num_blocks``), unless
        ``cache_blocks`` was given; until the first stats arrive the model is unbounded."""
        sizes = [int((r.routing_stats or {}).get("num_blocks", 0)) for r in replicas]
        if self.auto_cache_blocks and all(sizes):
            self.policy.cache_blocks = min(sizes)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # retries wait (Serve's backoff)
        loads = {uid: self._load(r) for uid, r in by_id.items()}
        self._size_prefix_cache(by_id.values())
        by_load = sorted(by_id, key=lambda uid: (loads[uid].load, uid))
        pinned = pending_request.kwargs.get("replica") if pending_request is not None else None
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return [[by_id[by_load[0]]]]
        rid = pending_request.metadata.internal_request_id
        self._release(rid)  # a retried choice replaces the earlier one
        hashes = prompt_block_hashes(pending_request.args[0], self.block_size)
        pick = self.policy.choose(hashes, loads)
        self._hashes[rid] = hashes
        # counted at once: requests routed concurrently see each other's choices, not only completed routings
        self._routed[rid] = pick
        self.inflight[pick] += 1
        return [[by_id[pick]], [by_id[uid] for uid in by_load if uid != pick]]

    def _release(self, internal_request_id: str) -> None:
        uid = self._routed.pop(internal_request_id, None)
        if uid is not None and self.inflight[uid] > 0:
            self.inflight[uid] -= 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        hashes = self._hashes.pop(rid, None)
        if hashes is None:
            return
        uid = replica_id.unique_id
        self.policy.on_routed(uid, hashes)
        self._release(rid)  # it went to the choice, or (the choice full or gone) to a lower rank
        self.inflight[uid] += 1
        self._routed[rid] = uid
        self.decisions.append((pending_request.args[2], uid, hashes[0] if hashes else None))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._release(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for uid in before - {r.unique_id for r in self.curr_replicas}:
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        self.policy.remove_replica(uid)
        self.inflight.pop(uid, None)
        for rid in [k for k, v in self._routed.items() if v == uid]:
            del self._routed[rid]


def get_router(deployment: str = DEPLOYMENT_NAME) -> Optional[KVServeRequestRouter]:
    """The request router of ``deployment``'s handle in this process (``None`` before its first request)."""
    return _ROUTERS.get(deployment)
