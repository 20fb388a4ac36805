"""Prometheus metrics of the server, with vLLM-like names (``kvserve:`` prefix).

Engine (``PrometheusStatLogger``). Histograms (seconds): ``kvserve:time_to_first_token_seconds``,
``kvserve:inter_token_latency_seconds``, ``kvserve:e2e_request_latency_seconds``, and the phases of a finished
request as vLLM splits them: ``kvserve:request_queue_time_seconds`` (arrival to first scheduled),
``kvserve:request_prefill_time_seconds`` (first scheduled to first token), ``kvserve:request_decode_time_seconds``
(first token to finish), ``kvserve:request_inference_time_seconds`` (first scheduled to finish). Gauges: ``kvserve:num_requests_running``, ``kvserve:num_requests_waiting``,
``kvserve:kv_cache_usage_perc`` (fraction of KV blocks in use, 0..1, as in vLLM). Counters:
``kvserve:num_preemptions_total``, ``kvserve:prompt_tokens_total``, ``kvserve:generation_tokens_total``,
``kvserve:request_success_total{finished_reason="stop"|"length"|"abort"}``, ``kvserve:prefix_cache_queries_total``,
``kvserve:prefix_cache_hits_total`` (tokens), ``kvserve:spec_decode_num_drafts_total``,
``kvserve:spec_decode_num_draft_tokens_total``, ``kvserve:spec_decode_num_accepted_tokens_total``. Token histograms of
finished requests: ``kvserve:request_prompt_tokens``, ``kvserve:request_generation_tokens`` and
``kvserve:request_max_num_generation_tokens`` (the longest of its ``n`` samples). With the prefix cache's disk tier
(``--kv-disk-cache-dir``): counters ``kvserve:kv_disk_cache_queries_total`` and ``kvserve:kv_disk_cache_hits_total``
(blocks looked up on disk / loaded from it), ``kvserve:kv_disk_cache_bad_entries_total``,
``kvserve:kv_disk_cache_read_bytes_total``, ``kvserve:kv_disk_cache_written_bytes_total``, the histogram
``kvserve:kv_disk_cache_load_seconds`` (one load job: read, verify, until its blocks are in the pool) and the gauge
``kvserve:kv_disk_cache_usage_bytes`` (the directory's entries, as this process last counted them). Every series
carries ``model_name``.

With ``vllm_metric_names`` (``kvserve serve --vllm-metric-names``) every engine series is also published under vLLM's
name (``vllm:`` for ``kvserve:``, ``VLLMNamesCollector``), plus the names vLLM's Grafana dashboard still reads
(``vllm:gpu_cache_usage_perc`` = ``kv_cache_usage_perc``, ``vllm:time_per_output_token_seconds`` =
``inter_token_latency_seconds``), so that dashboard works unchanged.

HTTP (``HTTPMetrics``, fed by ``HTTPMetricsMiddleware`` around the whole app, so 401s and 413s count too):
``http_requests_total{route,method,status}`` and ``http_request_duration_seconds{route,method}`` (until the last
byte of the response, a stream's included); ``route`` is the route's template (``/v1/models/{model_id:path}``) or
``other`` for an unknown path (never the raw path: bounded label values). With them, prometheus_client's process
(``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ``process_open_fds``, ...), platform
(``python_info``) and garbage-collector (``python_gc_*``) collectors.
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from starlette.routing import Match

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)
KV_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PrometheusStatLogger:
    """Records engine activity into its own ``CollectorRegistry`` (one per server, so several can live in one
    process). Called by ``AsyncLLM`` from its loop.

    Args:
        model_name: the ``model_name`` label.
        vllm_metric_names: also publish every engine series under vLLM's names (``VLLMNamesCollector``).
    """

    def __init__(self, model_name: str, vllm_metric_names: bool = False):
        self.registry = CollectorRegistry(auto_describe=True)
        self.vllm_registry: Optional[CollectorRegistry] = None
        if vllm_metric_names:
            self.vllm_registry = CollectorRegistry(auto_describe=False)
            self.vllm_registry.register(VLLMNamesCollector(self.registry))
        labels = ["model_name"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("kvserve:time_to_first_token_seconds", "Time to first token (arrival to first token), s.",
                         TTFT_BUCKETS)
        self.itl = hist("kvserve:inter_token_latency_seconds", "Time between consecutive output tokens, s.",
                        ITL_BUCKETS)
        self.e2e = hist("kvserve:e2e_request_latency_seconds", "Arrival to finish of finished requests, s.",
                        E2E_BUCKETS)
        self.queue_time = hist("kvserve:request_queue_time_seconds", "Arrival to first scheduled, s.", PHASE_BUCKETS)
        self.prefill_time = hist("kvserve:request_prefill_time_seconds", "First scheduled to first token, s.",
                                 PHASE_BUCKETS)
        self.decode_time = hist("kvserve:request_decode_time_seconds", "First token to finish, s.", PHASE_BUCKETS)
        self.inference_time = hist("kvserve:request_inference_time_seconds", "First scheduled to finish, s.",
                                   PHASE_BUCKETS)
        self.running = gauge("kvserve:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("kvserve:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kvserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1.")
        self.preemptions = counter("kvserve:num_preemptions", "Preemptions (by recompute) so far.")
        self.prompt_tokens = counter("kvserve:prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("kvserve:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("kvserve:spec_decode_num_drafts", "Speculative verification passes.")
        self.spec_draft_tokens = counter("kvserve:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("kvserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.tier_queries = counter("kvserve:kv_disk_cache_queries", "KV blocks looked up in the disk tier.")
        self.tier_hits = counter("kvserve:kv_disk_cache_hits", "KV blocks loaded from the disk tier.")
        self.tier_bad = counter("kvserve:kv_disk_cache_bad_entries", "Disk tier entries found torn, foreign or "
                                                                     "corrupted (recomputed).")
        self.tier_read = counter("kvserve:kv_disk_cache_read_bytes", "Bytes of KV blocks loaded from the disk tier.")
        self.tier_written = counter("kvserve:kv_disk_cache_written_bytes", "Bytes of KV blocks written to the disk "
                                                                           "tier.")
        self.tier_load = hist("kvserve:kv_disk_cache_load_seconds", "Disk tier load jobs, start to blocks in the "
                                                                    "pool, s.", KV_LOAD_BUCKETS)
        self.tier_usage = gauge("kvserve:kv_disk_cache_usage_bytes", "Bytes of the disk tier's entries.")
        self.request_prompt_tokens = hist("kvserve:request_prompt_tokens", "Prompt tokens of finished requests.",
                                          TOKEN_BUCKETS)
        self.request_generation_tokens = hist("kvserve:request_generation_tokens",
                                              "Generated tokens of finished requests (all samples).", TOKEN_BUCKETS)
        self.request_max_generation_tokens = hist("kvserve:request_max_num_generation_tokens",
                                                  "Most tokens generated by one sample of a finished request.",
                                                  TOKEN_BUCKETS)
        self._success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self._last_token_time: dict = {}
        self._seen: dict = {}

    def record(self, outputs: list, engine, now: float) -> None:
        """Observe one loop turn: per-request latencies from ``outputs`` (``RequestOutput`` list, possibly empty),
        then gauges and counters from ``engine`` (``scheduler``, ``kv_cache_stats()``, ``stats``, ``kv_tier``)."""
        for out in outputs:
            rid = out.request_id
            n_new = sum(len(c.delta_token_ids) for c in out.outputs)  # n samples, speculative steps
            last = self._last_token_time.get(rid)
            if last is None:
                if out.metrics.ttft is not None:
                    self.ttft.observe(out.metrics.ttft)
            elif n_new:
                for _ in range(n_new):
                    self.itl.observe((now - last) / n_new)
            if n_new:
                self._last_token_time[rid] = now
            if out.finished:
                self._last_token_time.pop(rid, None)
                self._observe_phases(out.metrics)
                lengths = [len(c.token_ids) for c in out.outputs]
                self.request_prompt_tokens.observe(len(out.prompt_token_ids))
                self.request_generation_tokens.observe(sum(lengths))
                self.request_max_generation_tokens.observe(max(lengths, default=0))
                self._success.labels(self.model_name, out.outputs[0].finish_reason or "stop").inc()
        sched = engine.scheduler
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(engine.kv_cache_stats().usage)
        stats = engine.stats
        spec = stats.spec_decode
        totals = [(self.preemptions, stats.num_preemptions), (self.prompt_tokens, stats.prompt_tokens),
                  (self.generation_tokens, stats.generation_tokens),
                  (self.prefix_queries, stats.prefix_cache_queries), (self.prefix_hits, stats.prefix_cache_hits)]
        if spec is not None:
            totals += [(self.spec_drafts, spec.num_drafts), (self.spec_draft_tokens, spec.num_draft_tokens),
                       (self.spec_accepted, spec.num_accepted_tokens)]
        tier = engine.kv_tier
        if tier is not None:
            t = tier.stats
            totals += [(self.tier_queries, t.lookups), (self.tier_hits, t.hits), (self.tier_bad, t.bad_entries),
                       (self.tier_read, t.bytes_read), (self.tier_written, t.bytes_written)]
            new_loads = t.loads - self._seen.get("tier_loads", 0)
            for seconds in t.load_seconds_samples[-new_loads:] if new_loads > 0 else ():
                self.tier_load.observe(seconds)
            self._seen["tier_loads"] = t.loads
            self.tier_usage.set(tier.store.bytes_estimate)
        for counter, value in totals:
            delta = value - self._seen.get(id(counter), 0)
            if delta > 0:
                counter.inc(delta)
            self._seen[id(counter)] = value

    def _observe_phases(self, m) -> None:
        """A finished request's ``RequestMetrics``: e2e latency and vLLM's queue / prefill / decode / inference
        split (a phase whose timestamps are missing is skipped)."""
        for hist, start, end in ((self.e2e, m.arrival_time, m.finish_time),
                                 (self.queue_time, m.arrival_time, m.first_scheduled_time),
                                 (self.prefill_time, m.first_scheduled_time, m.first_token_time),
                                 (self.decode_time, m.first_token_time, m.finish_time),
                                 (self.inference_time, m.first_scheduled_time, m.finish_time)):
            if start is not None and end is not None:
                hist.observe(max(0.0, end - start))

    def record_aborts(self, request_ids: list) -> None:
        """Count requests aborted before they finished (client gone or shutdown) and drop their state."""
        for rid in request_ids:
            self._last_token_time.pop(rid, None)
        self._success.labels(self.model_name, "abort").inc(len(request_ids))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (vLLM's names after kvserve's, when asked for)."""
        text = generate_latest(self.registry)
        return text if self.vllm_registry is None else text + generate_latest(self.vllm_registry)


#: vLLM names beyond the renamed prefix: ``kvserve:`` name -> further ``vllm:`` names of the same series (the
#: ones vLLM's Grafana dashboard reads).
VLLM_ALIASES = {"kvserve:kv_cache_usage_perc": ("vllm:gpu_cache_usage_perc",),
                "kvserve:inter_token_latency_seconds": ("vllm:time_per_output_token_seconds",)}


class VLLMNamesCollector:
    """A Prometheus collector that republishes the ``kvserve:`` series of ``source`` under vLLM's names: the prefix
    ``vllm:`` for ``kvserve:`` (same type, labels, values) and ``VLLM_ALIASES``. Registered in a registry of its own,
    read at each scrape (no copy to keep in step)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            if not family.name.startswith("kvserve:"):
                continue
            for name in ("vllm:" + family.name.removeprefix("kvserve:"), *VLLM_ALIASES.get(family.name, ())):
                renamed = Metric(name, family.documentation, family.type, family.unit)
                renamed.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
                yield renamed


class HTTPMetrics:
    """``http_requests_total{route,method,status}`` and ``http_request_duration_seconds{route,method}`` (both with
    ``model_name``) in ``registry``, with prometheus_client's process, platform and GC collectors; plain totals of
    4xx and 5xx answers for the dashboard (``error_totals``).

    Args:
        registry: the registry ``/metrics`` exposes.
        model_name: the ``model_name`` label.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        labels = ["model_name", "route", "method"]
        self.requests = Counter("http_requests", "HTTP requests answered, by route template, method and status.",
                                labels + ["status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Time to answer an HTTP request (the whole "
                                  "response, a stream's included), s.", labels, buckets=HTTP_BUCKETS,
                                  registry=registry)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        self.errors = {"4xx": 0, "5xx": 0}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        self.requests.labels(self.model_name, route, method, str(status)).inc()
        self.duration.labels(self.model_name, route, method).observe(seconds)
        if status >= 400:
            self.errors["5xx" if status >= 500 else "4xx"] += 1

    def error_totals(self) -> dict:
        """``{"http_4xx": n, "http_5xx": n}``: error answers since start."""
        return {"http_4xx": self.errors["4xx"], "http_5xx": self.errors["5xx"]}


class HTTPMetricsMiddleware:
    """ASGI middleware around the whole app (outside the API-key and body checks): times every HTTP request to
    the end of its response and counts it in ``metrics`` by route template, method and status (500 when the app
    raised before answering).

    Args:
        app: the ASGI app; its ``routes`` name the route of a request refused before routing (401, 413).
        metrics: an ``HTTPMetrics``.
        routes: the app's routes (``FastAPI.routes``), matched in order.
    """

    def __init__(self, app, metrics: HTTPMetrics, routes: list):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: Optional[int] = None

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status = status or 500
            raise
        finally:
            if status is not None:
                self.metrics.observe(self._route(scope), scope["method"], status, time.perf_counter() - start)

    def _route(self, scope) -> str:
        route = scope.get("route")
        if route is None:  # refused before routing; a wrong method (405) matches partly
            matches = [(r.matches(scope)[0], r) for r in _flat(self.routes)]
            route = next((r for m, r in matches if m == Match.FULL), None) or \
                next((r for m, r in matches if m == Match.PARTIAL), None)
        return getattr(route, "path", None) or "other"


def _flat(routes: list) -> list:
    """The leaf routes of ``routes``: those of an included router (FastAPI keeps one as a single entry holding the
    ``original_router``) or a mount are listed in its place."""
    out = []
    for r in routes:
        inner = getattr(getattr(r, "original_router", None), "routes", None) or getattr(r, "routes", None)
        out.extend(_flat(inner) if inner else [r])
    return out
