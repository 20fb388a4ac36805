"""Prometheus metrics of the server, with vLLM-like names (``kvserve:`` prefix).

Histograms (seconds): ``kvserve:time_to_first_token_seconds``, ``kvserve:inter_token_latency_seconds``,
``kvserve:e2e_request_latency_seconds``. Gauges: ``kvserve:num_requests_running``, ``kvserve:num_requests_waiting``,
``kvserve:kv_cache_usage_perc`` (fraction of KV blocks in use, 0..1, as in vLLM). Counters:
``kvserve:num_preemptions_total``, ``kvserve:prompt_tokens_total``, ``kvserve:generation_tokens_total``,
``kvserve:request_success_total{finished_reason="stop"|"length"|"abort"}``, ``kvserve:prefix_cache_queries_total``,
``kvserve:prefix_cache_hits_total`` (tokens), ``kvserve:spec_decode_num_drafts_total``,
``kvserve:spec_decode_num_draft_tokens_total``, ``kvserve:spec_decode_num_accepted_tokens_total``. Every series
carries ``model_name``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class PrometheusStatLogger:
    """Records engine activity into its own ``CollectorRegistry`` (one per server, so several can live in one
    process). Called by ``AsyncLLM`` from its loop.

    Args:
        model_name: the ``model_name`` label.
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
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
        self._success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self._last_token_time: dict = {}
        self._seen: dict = {}

    def record(self, outputs: list, engine, now: float) -> None:
        """Observe one loop turn: per-request latencies from ``outputs`` (``RequestOutput`` list, possibly empty),
        then gauges and counters from ``engine`` (``scheduler``, ``kv_cache_stats()``, ``stats``)."""
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
                if out.metrics.e2e is not None:
                    self.e2e.observe(out.metrics.e2e)
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
        for counter, value in totals:
            delta = value - self._seen.get(id(counter), 0)
            if delta > 0:
                counter.inc(delta)
            self._seen[id(counter)] = value

    def record_aborts(self, request_ids: list) -> None:
        """Count requests aborted before they finished (client gone or shutdown) and drop their state."""
        for rid in request_ids:
            self._last_token_time.pop(rid, None)
        self._success.labels(self.model_name, "abort").inc(len(request_ids))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
