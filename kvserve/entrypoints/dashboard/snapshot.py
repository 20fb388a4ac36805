"""What the dashboard shows, built from the engine's public state between steps; no model, no I/O, no asyncio.

Two pieces:

- ``build_snapshot(kv_cache_manager, running, waiting, ...)``: one JSON-ready ``dict`` of the KV block pool (the
  state of every block, ref counts of shared blocks, the cached-and-evictable blocks in LRU eviction order, each
  running request's block table) and the scheduler's queues. It only reads; the caller must hold the engine still
  while it runs (``hub.DashboardHub`` calls it from ``AsyncLLM``'s loop, between steps, under its lock). Its size is
  bounded: at most ``max_cells`` per-block entries (larger pools are sent as a density strip only),
  ``max_requests`` requests per queue and ``max_table_entries`` block-table entries in all.
- ``MetricsHistory``: the SLO numbers over the last minutes (TTFT / ITL / e2e percentiles, throughput, KV usage
  and waste, prefix-cache hit rate, preemptions, speculative acceptance), one point per ``interval_s``. Fed with
  every step's outputs (cheap: a few appends per output); a point is closed at most once per ``interval_s``.

The JSON schema of a snapshot and of a history point is documented in docs/server.md ("`GET /v1/engine/state`").
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

from kvserve.metrics import percentile

#: Version of the snapshot schema (docs/server.md, "`GET /v1/engine/state`"); bumped on any incompatible change.
SCHEMA_VERSION = 1

#: One character per block in ``kv.blocks``.
FREE, CACHED, USED, SHARED = "f", "c", "u", "s"

#: Prompt text is cut to this many characters when ``show_prompts`` is on.
MAX_PROMPT_CHARS = 200


def _free_block_ids_back_to_front(pool) -> Iterable[int]:
    """The ids in the pool's free queue from the back (freed last) to the front (reused / evicted first).

    ``BlockPool`` keeps the queue as the ``OrderedDict`` ``_free`` (block_id -> block); this is the one place the
    dashboard reads it.
    """
    return reversed(pool._free)


def build_snapshot(
    kv_cache_manager,
    running: list,
    waiting: list,
    *,
    seq: int = 0,
    now: Optional[float] = None,
    wall_time: Optional[float] = None,
    show_prompts: bool = False,
    spec_acceptance: Optional[dict] = None,
    max_cells: int = 65536,
    density_bins: int = 512,
    max_requests: int = 256,
    max_table_entries: int = 65536,
    engine_info: Optional[dict] = None,
    kv_tier: Optional[dict] = None,
) -> dict:
    """One snapshot of the block pool and the scheduler queues.

    Args:
        kv_cache_manager: a ``KVCacheManager``; reads its block tables (``req_to_blocks``, ``get_block_ids``) and
            its pool's ``cached`` map, ``num_free_blocks`` and free queue. Every referenced block must be in some
            block table (the pool invariant ``sum(ref_cnt) == block-table entries``).
        running: the scheduler's running requests, in order.
        waiting: the scheduler's waiting queue, in order (preempted requests included).
        seq: the snapshot's sequence number (increasing).
        now: ``time.monotonic()`` seconds, for request ages; default now.
        wall_time: ``time.time()`` seconds of the snapshot; default now.
        show_prompts: include each request's prompt text (cut to ``MAX_PROMPT_CHARS``); off: ids and counts only.
        spec_acceptance: request id -> the speculation policy's acceptance estimate (0..1) when speculative
            decoding is on (``Speculator.states``), else ``None`` (every request reports ``None``).
        max_cells: pools up to this many blocks get the per-block ``kv.blocks`` string and ``kv.cached_lru``;
            larger ones get ``null`` there and only ``kv.density``.
        density_bins: at most this many bins in ``kv.density``, each of ``ceil(num_blocks / density_bins)`` blocks.
        max_requests: at most this many requests per queue (the first ones); ``truncated`` says how many were cut.
        max_table_entries: at most this many block-table entries over all listed running requests; a table that
            no longer fits is sent as ``null``.
        engine_info: static facts passed through as ``engine`` (e.g. ``max_num_seqs``).
        kv_tier: the disk tier's numbers (``kv_tier_summary``), passed through as ``kv_tier``; ``None``: no tier.

    Returns:
        a ``dict`` of JSON types (schema: docs/server.md, "`GET /v1/engine/state`"); it shares no mutable object with the engine.
    """
    now = time.monotonic() if now is None else now
    wall_time = time.time() if wall_time is None else wall_time
    pool = kv_cache_manager.block_pool
    blocks = pool.blocks
    n = len(blocks)
    bs = kv_cache_manager.block_size

    # Only blocks that are referenced (through the block tables) or cached are visited, not the whole pool.
    state = bytearray(FREE.encode()) * n
    shared: dict = {}
    u, s = ord(USED), ord(SHARED)
    for table in kv_cache_manager.req_to_blocks.values():
        for b in table:
            if b is None:  # an entry freed behind a sliding window
                continue
            if b.ref_cnt > 1:
                state[b.block_id] = s
                shared[str(b.block_id)] = b.ref_cnt
            else:
                state[b.block_id] = u
    evictable = {b.block_id for b in pool.cached.values() if b.ref_cnt == 0}
    used = n - pool.num_free_blocks
    detail = n <= max_cells
    cached_lru = None
    if evictable:
        c = ord(CACHED)
        for bid in evictable:
            state[bid] = c
    if detail:  # evictable blocks were freed recently, so they sit near the back: walk the queue backwards
        cached_lru = []
        if evictable:
            for bid in _free_block_ids_back_to_front(pool):
                if bid in evictable:
                    cached_lru.append(bid)
                    if len(cached_lru) == len(evictable):
                        break
            cached_lru.reverse()

    bin_size = max(1, -(-n // density_bins))
    density = {"bin_size": bin_size, "used": [], "shared": [], "cached": []}
    for start in range(0, n, bin_size):
        chunk = state[start : start + bin_size]
        n_shared = chunk.count(b"s")
        density["used"].append(chunk.count(b"u") + n_shared)
        density["shared"].append(n_shared)
        density["cached"].append(chunk.count(b"c"))

    full_blocks: set = set()  # blocks whose block_size tokens all have K/V in some table
    partial: dict = {}  # block_id -> tokens with K/V, for the partly filled last block of a table
    table_budget = max_table_entries
    run_out = []
    for req in running[:max_requests]:
        d = _request_dict(req, now, show_prompts, spec_acceptance)
        table = kv_cache_manager.get_block_ids(req)
        # the blocks themselves, not the ids: an entry freed behind a sliding window shows NULL_BLOCK_ID (0), which
        # is also a real block's id
        held = kv_cache_manager.req_to_blocks.get(req.request_id, ())
        n_full, rest = divmod(req.num_computed_tokens, bs)
        full_blocks.update(b.block_id for b in held[:n_full] if b is not None)
        if rest and n_full < len(held) and held[n_full] is not None:
            b = held[n_full].block_id
            partial[b] = max(rest, partial.get(b, 0))
        if len(table) <= table_budget:
            d["block_table"] = table
            table_budget -= len(table)
        else:
            d["block_table"] = None
        run_out.append(d)
    wait_out = [_request_dict(req, now, show_prompts, spec_acceptance) for req in waiting[:max_requests]]

    allocated = used * bs
    tokens_stored = len(full_blocks) * bs + sum(k for bid, k in partial.items() if bid not in full_blocks)
    return {
        "version": SCHEMA_VERSION,
        "seq": seq,
        "time": wall_time,
        "engine": dict(engine_info or {}),
        "kv": {
            "num_blocks": n,
            "block_size": bs,
            "used_blocks": used,
            "shared_blocks": len(shared),
            "cached_blocks": len(evictable),
            "free_blocks": n - used,
            "kv_cache_usage_perc": used / n,
            "tokens_allocated": allocated,
            "tokens_stored": tokens_stored,
            "waste": (allocated - tokens_stored) / allocated if allocated and len(running) <= max_requests else None,
            "blocks": state.decode() if detail else None,
            "shared": shared if detail else None,
            "cached_lru": cached_lru,
            "density": density,
        },
        "kv_tier": None if kv_tier is None else dict(kv_tier),
        "running": run_out,
        "waiting": wait_out,
        "num_running": len(running),
        "num_waiting": len(waiting),
        "truncated": {"running": max(0, len(running) - max_requests), "waiting": max(0, len(waiting) - max_requests)},
    }


def kv_tier_summary(tier, num_loading: int = 0) -> dict:
    """The prefix cache's disk tier at a glance (a ``KVDiskTier``): blocks looked up / loaded / missed, bad
    entries, bytes read / written, blocks written and dropped, load jobs and their mean time (ms), whether writes
    are on, the directory's bytes against its budget, and ``num_loading`` requests waiting for a load now."""
    s, store = tier.stats, tier.store
    return {
        "lookups": s.lookups,
        "hits": s.hits,
        "misses": s.misses,
        "hit_rate": round(s.hit_rate, 4),
        "bad_entries": s.bad_entries,
        "bytes_read": s.bytes_read,
        "bytes_written": s.bytes_written,
        "blocks_written": s.blocks_written,
        "writes_dropped": s.writes_dropped,
        "loads": s.loads,
        "mean_load_ms": round(1000 * s.load_seconds / s.loads, 3) if s.loads else None,
        "write_enabled": store.write_enabled,
        "bytes_on_disk": store.bytes_estimate,
        "capacity_bytes": store.capacity_bytes,
        "num_loading": num_loading,
    }


def _request_dict(req, now: float, show_prompts: bool, spec_acceptance: Optional[dict]) -> dict:
    """The fields of one request the page shows (token counts, progress, priority, preemptions, acceptance)."""
    sp = req.sampling_params
    d = {
        "id": req.request_id,
        "parent_id": getattr(req, "parent_id", None),
        "status": req.status.value,
        "prompt_tokens": req.num_prompt_tokens,
        "output_tokens": len(req.output_token_ids),
        "max_tokens": sp.max_tokens,
        "num_tokens": req.num_tokens,
        "num_computed_tokens": req.num_computed_tokens,
        "priority": req.priority,
        "num_preemptions": req.num_preemptions,
        "spec_acceptance": (spec_acceptance or {}).get(req.request_id),
        "age_s": round(max(0.0, now - req.arrival_time), 3),
        "ttft_s": (round(req.first_token_time - req.arrival_time, 4) if req.first_token_time is not None else None),
    }
    if show_prompts:
        text = req.prompt
        d["prompt"] = None if text is None else text[:MAX_PROMPT_CHARS]
    return d


class MetricsHistory:
    """The SLO numbers over the last ``window_s`` seconds, one point per ``interval_s``.

    Args:
        interval_s: seconds between points.
        window_s: how far back points are kept (``window_s / interval_s`` points at most).
        latency_window_s: latency percentiles of a point are over the observations of the last this many seconds.
        max_observations: at most this many latency observations per kind are kept (the oldest are dropped).

    Each point (a ``dict``) has ``t`` (``time.time()`` seconds), ``dt`` (seconds since the previous point),
    ``ttft_ms`` / ``itl_ms`` / ``e2e_ms`` (``[p50, p90, p99]`` in milliseconds, or ``None`` with no observation in
    the latency window), ``output_tok_s`` and ``prompt_tok_s`` (tokens/s over the interval), ``kv_usage`` and
    ``kv_waste`` (0..1 at the point; waste ``None`` with nothing allocated), ``prefix_hit_rate`` (0..1 over the
    prompt tokens looked up in the interval, ``None`` with none), ``preemptions`` (count in the interval),
    ``spec_acceptance`` (0..1 over the draft tokens of the interval, ``None`` with none), ``running``, ``waiting``,
    ``http_4xx`` and ``http_5xx`` (error answers in the interval; 0 without the server's counts).
    """

    def __init__(self, interval_s: float = 1.0, window_s: float = 300.0, latency_window_s: float = 10.0,
                 max_observations: int = 20000):
        if interval_s <= 0 or window_s < interval_s or latency_window_s <= 0:
            raise ValueError("need interval_s > 0, window_s >= interval_s and latency_window_s > 0")
        self.interval_s = interval_s
        self.latency_window_s = latency_window_s
        self.points: deque = deque(maxlen=max(1, int(window_s / interval_s)))
        self._obs = {k: deque(maxlen=max_observations) for k in ("ttft", "itl", "e2e")}
        self._last_token_time: dict = {}
        self._last_close: Optional[float] = None
        self._last_totals: Optional[dict] = None

    def record_outputs(self, outputs: list, now: float) -> None:
        """Observe one step's ``RequestOutput`` list (``now``: ``time.monotonic()`` seconds after the step):
        TTFT of a request's first output, ITL per new token (the time since its previous output, split evenly
        over the tokens it brought), e2e of finished ones."""
        obs = self._obs
        for out in outputs:
            rid = out.request_id
            n_new = sum(len(c.delta_token_ids) for c in out.outputs)
            last = self._last_token_time.get(rid)
            if last is None:
                if out.metrics.ttft is not None:
                    obs["ttft"].append((now, out.metrics.ttft))
            elif n_new:
                gap = (now - last) / n_new
                for _ in range(n_new):
                    obs["itl"].append((now, gap))
            if n_new:
                self._last_token_time[rid] = now
            if out.finished:
                self._last_token_time.pop(rid, None)
                if out.metrics.e2e is not None:
                    obs["e2e"].append((now, out.metrics.e2e))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state of aborted requests."""
        for rid in request_ids:
            self._last_token_time.pop(rid, None)

    def due(self, now: float) -> bool:
        """True if a point should be closed at ``now`` (``interval_s`` after the last one, or never closed)."""
        return self._last_close is None or now - self._last_close >= self.interval_s

    def close(self, now: float, totals: dict, kv_usage: float, kv_waste: Optional[float], running: int,
              waiting: int, wall_time: Optional[float] = None) -> Optional[dict]:
        """Close one point.

        Args:
            now: ``time.monotonic()`` seconds.
            totals: cumulative counters since start: ``prompt_tokens``, ``generation_tokens``,
                ``num_preemptions``, ``prefix_cache_queries``, ``prefix_cache_hits`` (tokens),
                ``spec_draft_tokens``, ``spec_accepted_tokens``; optionally ``http_4xx``, ``http_5xx`` (error
                answers).
            kv_usage: fraction of blocks in use, 0..1; kv_waste: allocated-but-unused slots / allocated, or ``None``.
            running, waiting: queue lengths.
            wall_time: ``time.time()`` of the point; default now.

        Returns:
            the new point, or ``None`` for the very first call (it only sets the baseline of the counters).
        """
        wall_time = time.time() if wall_time is None else wall_time
        prev, prev_t = self._last_totals, self._last_close
        self._last_totals, self._last_close = dict(totals), now
        if prev is None:
            return None
        dt = now - prev_t
        delta = {k: totals.get(k, 0) - prev.get(k, 0) for k in totals}
        horizon = now - self.latency_window_s
        pct = {}
        for kind, obs in self._obs.items():
            while obs and obs[0][0] < horizon:
                obs.popleft()
            values = [v for _, v in obs]
            pct[kind] = ([round(percentile(values, q) * 1000, 2) for q in (50, 90, 99)] if values else None)
        queries = delta.get("prefix_cache_queries", 0)
        drafts = delta.get("spec_draft_tokens", 0)
        point = {
            "t": round(wall_time, 3),
            "dt": round(dt, 3),
            "ttft_ms": pct["ttft"],
            "itl_ms": pct["itl"],
            "e2e_ms": pct["e2e"],
            "output_tok_s": round(delta.get("generation_tokens", 0) / dt, 2) if dt > 0 else 0.0,
            "prompt_tok_s": round(delta.get("prompt_tokens", 0) / dt, 2) if dt > 0 else 0.0,
            "kv_usage": round(kv_usage, 4),
            "kv_waste": None if kv_waste is None else round(kv_waste, 4),
            "prefix_hit_rate": round(delta.get("prefix_cache_hits", 0) / queries, 4) if queries > 0 else None,
            "preemptions": delta.get("num_preemptions", 0),
            "spec_acceptance": round(delta.get("spec_accepted_tokens", 0) / drafts, 4) if drafts > 0 else None,
            "running": running,
            "waiting": waiting,
            "http_4xx": delta.get("http_4xx", 0),
            "http_5xx": delta.get("http_5xx", 0),
        }
        self.points.append(point)
        return point

    def since(self, t: Optional[float]) -> list:
        """The points with ``point["t"] > t`` (all of them for ``t=None``), oldest first."""
        if t is None:
            return list(self.points)
        return [p for p in self.points if p["t"] > t]
