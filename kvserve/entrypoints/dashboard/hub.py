"""The live dashboard: ``GET /dashboard`` (one static HTML/JS/CSS bundle) and ``GET /v1/engine/state``.

``DashboardHub`` is ``AsyncLLM``'s ``state_observer``: the engine loop calls ``observe(outputs, engine, now)``
after every turn, between steps and under the loop's lock. It always feeds the cheap ``MetricsHistory``; it builds
a snapshot (``snapshot.build_snapshot``) only while at least one viewer is subscribed, and at most at
the fastest viewer's rate (≤ 10 Hz). A snapshot is handed to each viewer by overwriting that viewer's one-slot
mailbox and setting an ``asyncio.Event``: nothing is queued, nothing is awaited, so a slow or vanished viewer costs
the engine nothing (it simply skips snapshots), and the JSON encoding happens in the viewer's own coroutine. While
the engine is idle a viewer wakes the loop once a second (``AsyncLLM.wake``) so the page keeps ticking.

The page and the endpoint exist only when the server is started with the dashboard on (``--dashboard``; the default
when binding a loopback address). Request text is included only with ``--dashboard-show-prompts``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import time
from importlib import resources
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.dashboard.snapshot import MetricsHistory, build_snapshot, kv_tier_summary

logger = logging.getLogger(__name__)

#: Highest update rate a viewer may ask for, Hz.
MAX_HZ = 10.0
#: Most viewers (streams and pending one-shot reads) at once; more are refused with a 503.
MAX_VIEWERS = 16
#: While the engine is idle, a viewer asks for a fresh snapshot this often, seconds.
IDLE_POKE_S = 1.0

_STATIC = ("dashboard.html", "dashboard.js", "dashboard.css")
_TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); ``0.0.0.0`` and names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_args(parser: argparse.ArgumentParser) -> None:
    """``--dashboard`` / ``--no-dashboard`` and ``--dashboard-show-prompts``."""
    parser.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                        help="serve the live page /dashboard and GET /v1/engine/state (default: on when --host is "
                             "a loopback address, off otherwise)")
    parser.add_argument("--dashboard-show-prompts", action="store_true",
                        help="show request prompt text on the dashboard (default: ids and token counts only)")


class _Snapshot:
    """One built snapshot; encoded to JSON once, by the first viewer that sends it."""

    __slots__ = ("data", "_json")

    def __init__(self, data: dict):
        self.data = data
        self._json: Optional[bytes] = None

    def json(self) -> bytes:
        if self._json is None:
            self._json = json.dumps(self.data, separators=(",", ":")).encode()
        return self._json


class Viewer:
    """One subscriber: a one-slot mailbox (the latest snapshot) and an event. ``hz``: its update rate."""

    def __init__(self, hz: float):
        self.hz = hz
        self.latest: Optional[_Snapshot] = None
        self.event = asyncio.Event()

    def offer(self, snap: _Snapshot) -> None:
        self.latest = snap  # an unread older snapshot is simply replaced
        self.event.set()

    async def next(self, timeout: float) -> Optional[_Snapshot]:
        """The newest snapshot not yet taken, waiting up to ``timeout`` seconds; ``None`` on timeout."""
        if not self.event.is_set():
            try:
                await asyncio.wait_for(self.event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        self.event.clear()
        snap, self.latest = self.latest, None
        return snap


class DashboardHub:
    """Builds snapshots for subscribed viewers and keeps the metric history (see the module docstring).

    Args:
        llm: the ``AsyncLLM`` (its ``wake()`` is used while idle).
        model_name: shown on the page.
        show_prompts: include prompt text in snapshots.
        history: the history to feed; default one point per second over 5 minutes.
        max_cells: see ``build_snapshot``.
    """

    def __init__(self, llm, model_name: str, show_prompts: bool = False,
                 history: Optional[MetricsHistory] = None, max_cells: int = 65536):
        self.llm = llm
        self.model_name = model_name
        self.show_prompts = show_prompts
        self.history = history or MetricsHistory()
        self.max_cells = max_cells
        self.viewers: set = set()
        self.num_snapshots = 0
        self._last_build = -1e9
        self._engine_info: Optional[dict] = None
        self._failed = False
        #: optional ``() -> {"http_4xx": n, "http_5xx": n}``, error answers since start (``HTTPMetrics.error_totals``)
        self.http_totals = None

    # ------------------------------------------------------------------------------------------- engine side
    def observe(self, outputs: list, engine, now: float) -> None:
        """Called by the engine loop between steps (never awaits): record ``outputs``, close a history point when
        due, and build a snapshot if a viewer is subscribed and the fastest viewer's interval has passed. An error
        here is logged (once) and swallowed: the dashboard never stops the engine."""
        try:
            self._observe(outputs, engine, now)
        except Exception:  # noqa: BLE001
            if not self._failed:
                logger.exception("dashboard: observing the engine failed; serving goes on")
                self._failed = True

    def _observe(self, outputs: list, engine, now: float) -> None:
        hist = self.history
        hist.record_outputs(outputs, now)
        if hist.due(now):
            kv = engine.kv_cache_stats()
            totals = _totals(engine)
            if self.http_totals is not None:
                totals.update(self.http_totals())
            hist.close(now, totals, kv.usage, kv.waste if kv.tokens_allocated else None,
                       engine.scheduler.num_running, engine.scheduler.num_waiting)
        if not self.viewers:
            return
        hz = max(v.hz for v in self.viewers)
        if now - self._last_build < 1.0 / hz - 1e-3:
            return
        self._last_build = now
        self.num_snapshots += 1
        sched = engine.scheduler
        t0 = time.perf_counter()
        tier = engine.kv_tier
        loading = sched.loading_requests
        data = build_snapshot(
            engine.kv_cache_manager, sched.running, loading + sched.waiting, seq=self.num_snapshots, now=now,
            show_prompts=self.show_prompts, spec_acceptance=_spec_acceptance(engine),
            max_cells=self.max_cells, engine_info=self._info(engine),
            kv_tier=None if tier is None else kv_tier_summary(tier, len(loading)))
        data["build_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        snap = _Snapshot(data)
        for v in self.viewers:
            v.offer(snap)

    def forget(self, request_ids: list) -> None:
        """Aborted requests (the engine loop calls this with the ids it aborted)."""
        self.history.forget(request_ids)

    def _info(self, engine) -> dict:
        if self._engine_info is None:
            sc = engine.config.scheduler_config
            self._engine_info = {
                "model": self.model_name,
                "max_num_seqs": sc.max_num_seqs,
                "max_num_batched_tokens": sc.max_num_batched_tokens,
                "scheduling": sc.scheduling,
                "scheduling_policy": sc.scheduling_policy,
                "enable_prefix_caching": engine.kv_cache_manager.enable_prefix_caching,
                "kv_disk_cache_dir": engine.config.cache_config.kv_disk_cache_dir,
                "num_speculative_tokens": engine.speculator.policy.max_k if engine.speculator is not None else 0,
                "max_model_len": engine.max_model_len,
                "show_prompts": self.show_prompts,
            }
        return self._engine_info

    # ------------------------------------------------------------------------------------------- viewer side
    def subscribe(self, hz: float) -> Viewer:
        """Add a viewer. Raises ``RuntimeError`` when ``MAX_VIEWERS`` are already subscribed."""
        if len(self.viewers) >= MAX_VIEWERS:
            raise RuntimeError(f"at most {MAX_VIEWERS} dashboard viewers at once")
        v = Viewer(hz)
        self.viewers.add(v)
        self.llm.wake()  # the first snapshot comes at the next loop turn, even when idle
        return v

    def unsubscribe(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)

    async def next_snapshot(self, viewer: Viewer, timeout: float) -> Optional[_Snapshot]:
        """The viewer's next snapshot; wakes the idle engine loop every ``IDLE_POKE_S``; ``None`` after
        ``timeout`` seconds without one (or when the engine loop is not running)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.llm.is_running:
                return None
            snap = await viewer.next(min(left, IDLE_POKE_S))
            if snap is not None:
                return snap
            self.llm.wake()


def _totals(engine) -> dict:
    """The cumulative counters ``MetricsHistory.close`` takes, from ``engine.stats``."""
    st = engine.stats
    spec = getattr(st, "spec_decode", None)
    return {
        "prompt_tokens": st.prompt_tokens,
        "generation_tokens": st.generation_tokens,
        "num_preemptions": st.num_preemptions,
        "prefix_cache_queries": st.prefix_cache_queries,
        "prefix_cache_hits": st.prefix_cache_hits,
        "spec_draft_tokens": spec.num_draft_tokens if spec is not None else 0,
        "spec_accepted_tokens": spec.num_accepted_tokens if spec is not None else 0,
    }


def _error(message: str, status: int, param: Optional[str] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error" if status == 400 else "server_error",
                      "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _spec_acceptance(engine) -> Optional[dict]:
    """Request id -> acceptance estimate of the speculation policy, or ``None`` without speculative decoding."""
    if engine.speculator is None:
        return None
    return {rid: round(st.acceptance, 4) for rid, st in engine.speculator.states.items()}


def page_paths() -> frozenset[str]:
    """The paths of the page's static files (HTML, JS, CSS): they carry no engine data, and a browser opening the
    page cannot send an ``Authorization`` header, so ``--api-key`` leaves them open; the data endpoint
    ``/v1/engine/state`` still needs the key (the page sends the one given as ``/dashboard#key=...``)."""
    return frozenset({"/dashboard"} | {f"/dashboard/{name}" for name in _STATIC if name != "dashboard.html"})


def mount_dashboard(app: FastAPI, llm, model_name: str, show_prompts: bool = False) -> DashboardHub:
    """Add ``/dashboard`` and ``/v1/engine/state`` to ``app`` and attach a ``DashboardHub`` to ``llm`` as its
    ``state_observer``. The routes are left out of the OpenAPI schema (docs/server.md, "Dashboard", documents them)."""
    hub = DashboardHub(llm, model_name, show_prompts=show_prompts)
    llm.state_observer = hub
    files = {name: resources.files("kvserve.entrypoints.dashboard").joinpath("static", name).read_bytes()
             for name in _STATIC}

    def static(name: str) -> Response:
        return Response(files[name], media_type=_TYPES[name.rsplit(".", 1)[1]], headers=_HEADERS)

    @app.api_route("/dashboard", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard_page():
        return static("dashboard.html")

    @app.api_route("/dashboard/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard_file(name: str):
        if name not in files or name == "dashboard.html":
            return _error(f"no such dashboard file: {name}", 404)
        return static(name)

    @app.get("/v1/engine/state", include_in_schema=False)
    async def engine_state(request: Request):
        """One JSON snapshot ``{"snapshot", "history"}``, or with ``?stream=true`` (or ``Accept:
        text/event-stream``) server-sent events ``event: state`` / ``data: {"snapshot", "history"}`` at up to
        ``hz`` per second (default and most 10), ``history`` holding only points new since the previous event."""
        q = request.query_params
        unknown = set(q) - {"stream", "hz"}
        if unknown:
            return _error(f"unrecognized query parameter: {sorted(unknown)[0]}", 400, sorted(unknown)[0])
        stream_arg = q.get("stream", "false").lower()
        if stream_arg not in ("1", "true", "0", "false"):
            return _error("stream must be true or false", 400, "stream")
        if "stream" in q:
            stream = stream_arg in ("1", "true")
        else:
            stream = "text/event-stream" in request.headers.get("accept", "")
        try:
            hz = float(q.get("hz", MAX_HZ))
        except ValueError:
            hz = -1.0
        if not 0 < hz <= MAX_HZ:  # (also rejects nan)
            return _error(f"hz must be in (0, {MAX_HZ:g}]", 400, "hz")
        try:
            viewer = hub.subscribe(hz)
        except RuntimeError as e:
            return _error(str(e), 503)
        if not stream:
            try:
                snap = await hub.next_snapshot(viewer, timeout=5.0)
            finally:
                hub.unsubscribe(viewer)
            if snap is None:
                return _error("the engine is not running", 503)
            body = b'{"snapshot":' + snap.json() + b',"history":' + json.dumps(hub.history.since(None)).encode() + b"}"
            return Response(body, media_type="application/json", headers={"Cache-Control": "no-cache"})

        async def events():
            last_t = None
            try:
                while True:
                    snap = await hub.next_snapshot(viewer, timeout=3600.0)
                    if snap is None:
                        return
                    points = hub.history.since(last_t)
                    if points:
                        last_t = points[-1]["t"]
                    sent = time.monotonic()
                    yield (b"event: state\ndata: {\"snapshot\":" + snap.json() + b",\"history\":"
                           + json.dumps(points, separators=(",", ":")).encode() + b"}\n\n")
                    rest = 1.0 / viewer.hz - (time.monotonic() - sent)
                    if rest > 0:  # a slower viewer: its mailbox keeps only the newest snapshot meanwhile
                        await asyncio.sleep(rest)
            finally:
                hub.unsubscribe(viewer)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return hub
