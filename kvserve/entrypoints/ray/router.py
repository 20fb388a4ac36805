"""The Ray Serve request router of the ``KVServeReplica`` deployment (``KVServeRequestRouter``): Serve's
``RequestRouter`` interface over ``kvserve.distributed.router``'s policies; ``get_router`` finds this process's."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.distributed.router import ReplicaLoad, make_router, prompt_block_hashes
from kvserve.entrypoints.ray.replica import DEPLOYMENT_NAME

_ROUTERS: dict = {}  # deployment name -> the KVServeRequestRouter in this process (created by the ingress's handle)


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
        import kvserve.entrypoints.ray.router as imported

        imported._ROUTERS[deployment] = self

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
