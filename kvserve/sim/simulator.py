"""``kvserve sim``: replay a trace through the real ``Scheduler`` and ``KVCacheManager`` on a simulated clock.

Nothing of the scheduling is modelled: the engine's own scheduler (continuous or static, fcfs or priority, chunked
prefill, preemption by recompute) and KV cache manager (paging, prefix caching with real block hashes) run
unchanged. Only the model is replaced: a model-free runner (``kvserve.core.fake_runner``) gives each sampling request a fixed token (requests
ignore EOS, so each generates exactly its trace output length), and the clock advances by the cost model's
prediction for the step's plan (``kvserve.sim.cost_model``), measured on the real engine (``kvserve sim profile``).

The loop mirrors ``AsyncLLM``'s: requests that arrived by the current time are added between steps; an idle engine
waits for the next arrival; tokens of a step are delivered when the step ends. Requests the real engine would
reject (longer than ``max_model_len``, than the pool, or, unchunked, than the token budget; prompt + output beyond
``max_model_len``, the server's 400) are counted as failed, as ``kvserve bench serve`` counts them.

The per-request results are ``kvserve.metrics.RequestResult`` objects and the summary is
``kvserve.metrics.summarize``'s, so a simulated run and a real load test print the same table.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_needed
from kvserve.core.fake_runner import fake_run
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.metrics import RequestResult, summarize
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sim.trace import TraceRequest, prompt_token_ids

SIM_TOKEN_ID = 7  # the token every simulated sample gets (requests ignore EOS)


@dataclass
class SimResult:
    """One simulated run.

    Attributes:
        summary: ``kvserve.metrics.summarize``'s dict (latencies in ms, throughputs per s, goodput) plus
            ``steps``, ``preemptions``, ``prefix_cache_hit_rate`` / ``prefix_cache_queries`` (as ``bench serve`` reads
            them from the server), ``kv_usage_mean`` / ``kv_usage_max`` (fraction of
            blocks), ``rejected``, ``num_blocks``, ``sim_wall_s``.
        results: one ``RequestResult`` per trace request, in trace order.
        kv_usage: ``(t_s, used_fraction, running, waiting)`` samples over time (every ``sample_every`` steps).
    """

    summary: dict
    results: list
    kv_usage: list = field(default_factory=list)


class Simulator:
    """The real scheduler and KV cache manager of ``config`` on a simulated clock.

    Args:
        config: the engine configuration (same flags as ``kvserve serve``).
        step_time: ``SchedulerOutput -> seconds`` (a ``CostModel``).
        num_blocks: the KV pool (the engine derives it from the memory budget and the model's bytes per block).
        max_model_len: the model's longest sequence (``config.model_config.max_model_len`` wins when set).
    """

    def __init__(self, config: EngineConfig, step_time: Callable[[SchedulerOutput], float], num_blocks: int,
                 max_model_len: int):
        self.config = config
        self.step_time = step_time
        self.num_blocks = num_blocks
        cc, sc = config.cache_config, config.scheduler_config
        self.block_size = cc.block_size
        self.max_model_len = config.model_config.max_model_len or max_model_len
        self.max_total_tokens = min(self.max_model_len, num_blocks * cc.block_size)
        if not sc.enable_chunked_prefill:
            self.max_total_tokens = min(self.max_total_tokens, sc.max_num_batched_tokens)

    def reject_reason(self, r: TraceRequest) -> Optional[str]:
        """Why the real engine / server would refuse ``r`` (``None`` if it accepts it)."""
        sc = self.config.scheduler_config
        if r.prompt_len + r.output_len > self.max_model_len:
            return f"prompt + output {r.prompt_len + r.output_len} > max_model_len {self.max_model_len}"
        if blocks_needed(r.prompt_len, self.block_size) > self.num_blocks:
            return f"prompt needs more than the pool's {self.num_blocks} blocks"
        if not sc.enable_chunked_prefill and r.prompt_len > sc.max_num_batched_tokens:
            return f"prompt > max_num_batched_tokens {sc.max_num_batched_tokens} without chunked prefill"
        return None

    def output_tokens(self, r: TraceRequest) -> int:
        """The tokens the engine returns for ``r``: its ``output_len``, or fewer when prompt + output would pass
        ``max_total_tokens`` (without chunked prefill that is the token budget): the engine then ends the request
        at that length (``finish_reason`` "length"), and the benchmark client counts it as completed."""
        return max(1, min(r.output_len, self.max_total_tokens - r.prompt_len))

    @staticmethod
    def cut_short(r: TraceRequest, res) -> bool:
        """Whether ``res`` (a ``RequestResult``) completed with fewer tokens than ``r.output_len``
        (``output_tokens``)."""
        return res.success and res.output_tokens < r.output_len

    @staticmethod
    def num_truncated(trace: list[TraceRequest], results: list) -> int:
        """Completed requests cut short (``cut_short``)."""
        return sum(1 for r, res in zip(trace, results) if Simulator.cut_short(r, res))

    def run(self, trace: list[TraceRequest], slos: Optional[dict] = None, sample_every: int = 1) -> SimResult:
        """Simulate ``trace`` (arrivals in non-decreasing order) to the last request's end.

        Args:
            trace: the requests.
            slos: goodput SLOs in seconds, ``{"ttft": .5, "tpot": .1, "e2el": ...}`` (``bench serve``'s).
            sample_every: record KV usage every this many steps.

        Raises:
            ValueError: arrivals out of order.
        """
        wall0 = time.perf_counter()
        order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
        if order != list(range(len(trace))):
            raise ValueError("trace arrivals must be in non-decreasing order")
        kv = KVCacheManager(self.num_blocks, self.block_size, self.config.cache_config.enable_prefix_caching)
        sched = Scheduler(self.config.scheduler_config, kv, eos_token_ids=())
        pool = kv.block_pool
        results = [RequestResult() for _ in trace]
        arrival = [r.arrival_s for r in trace]
        index_of: dict[str, int] = {}  # request id -> trace index
        n = len(trace)
        t, i, steps = 0.0, 0, 0
        usage_sum, usage_max, samples = 0.0, 0.0, []
        running_time = 0.0
        # Token deliveries, kept flat and turned into per-request results once at the end (numpy): per step its
        # end time and how many tokens it delivered, and the trace index of each delivered token in step order.
        step_end, step_tokens, token_req = [], [], []
        gc_was_enabled = gc.isenabled()
        gc.disable()  # millions of short-lived plan objects and no cycles: the collector would only rescan them
        try:
            while i < n or sched.has_unfinished_requests():
                if not sched.has_unfinished_requests() and arrival[i] > t:
                    t = arrival[i]  # an idle engine waits for the next arrival
                while i < n and arrival[i] <= t:
                    r = trace[i]
                    res = results[i]
                    res.start_s, res.prompt_tokens = r.arrival_s, r.prompt_len
                    why = self.reject_reason(r)
                    if why:
                        res.error = f"HTTP 400: {why}"
                    else:
                        sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0)
                        rid = str(i)
                        index_of[rid] = i
                        sched.add_request(Request(rid, prompt_token_ids(r, i), sp, self.max_total_tokens,
                                                  arrival_time=r.arrival_s, priority=r.priority))
                    i += 1
                if not sched.has_unfinished_requests():
                    continue
                so = sched.schedule()
                if not so.scheduled:  # only possible with nothing running: a request that can never be admitted
                    raise RuntimeError(f"the scheduler made no progress at t={t:.3f} s with "
                                       f"{sched.num_waiting} waiting; check the pool size and token budget")
                dt = self.step_time(so)
                t += dt
                running_time += dt
                out = fake_run(so, SIM_TOKEN_ID)
                sched.update_from_output(so, out)
                steps += 1
                delivered = out.sampled_token_ids
                step_end.append(t)
                step_tokens.append(len(delivered))
                token_req.extend(map(index_of.__getitem__, delivered))
                used = pool.num_used_blocks / self.num_blocks
                usage_sum += used * dt
                if used > usage_max:
                    usage_max = used
                if steps % sample_every == 0:
                    samples.append((t, used, sched.num_running, sched.num_waiting))
        finally:
            if gc_was_enabled:
                gc.enable()
        self._fill_results(trace, results, step_end, step_tokens, token_req)
        duration = t  # like bench serve: from the first send to the last byte
        summary = summarize(results, duration, slos or {})
        summary.update({
            "steps": steps,
            "preemptions": sched.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0,
            "kv_usage_mean": usage_sum / running_time if running_time else 0.0,
            "kv_usage_max": usage_max,
            "rejected": sum(1 for r in results if r.error.startswith("HTTP 400")),
            "truncated": self.num_truncated(trace, results),
            "num_blocks": self.num_blocks,
            "busy_s": running_time,
            "sim_wall_s": time.perf_counter() - wall0,
        })
        return SimResult(summary, results, samples)

    def _fill_results(self, trace: list[TraceRequest], results: list, step_end: list, step_tokens: list,
                      token_req: list) -> None:
        """Per-request TTFT, ITL, e2e latency, token count and success from the flat token deliveries: token ``j``
        of the run went to request ``token_req[j]``; step ``k`` ended at ``step_end[k]`` (seconds) and delivered
        ``step_tokens[k]`` tokens. Latencies are differences of the same float times a per-token loop would take."""
        if not token_req:
            return
        req = np.asarray(token_req, dtype=np.int64)
        when = np.repeat(np.asarray(step_end, dtype=np.float64), np.asarray(step_tokens, dtype=np.int64))
        order = np.argsort(req, kind="stable")  # each request's tokens, in delivery order
        req, when = req[order], when[order]
        bounds = np.flatnonzero(np.diff(req)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        ends = np.concatenate((bounds, [len(req)])).tolist()
        for a, b in zip(starts, ends):
            k = int(req[a])
            res, times = results[k], when[a:b]
            arrival = trace[k].arrival_s
            res.output_tokens = b - a
            res.ttft = float(times[0]) - arrival
            res.itl = np.diff(times).tolist()
            if res.output_tokens == self.output_tokens(trace[k]):
                res.success = True
                res.e2el = float(times[-1]) - arrival


def overload_warning(trace: list[TraceRequest], summary: dict):
    """A warning (``str``) when the trace offers more load than the simulated engine serves, else ``None``.

    Offered: the arrivals' mean rate (``len(trace) - 1`` gaps over their span, req/s); served: completed requests over the
    simulated duration. The engine is overloaded when it served under 80% of the offered rate while busy (stepping)
    at least 90% of the time: its queue then grows for the whole trace, and latencies depend on the trace's length
    more than on the engine. The capacity named is completed requests per busy second (the rate this mix of
    requests can be served at, as batched in this run). A trace sent all at once (arrival span 0) is never flagged.
    """
    arrivals = [r.arrival_s for r in trace]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    duration, busy = summary["duration_s"], summary.get("busy_s", 0.0)
    if span <= 0 or duration <= 0 or busy <= 0 or not summary["completed"]:
        return None
    offered, served = (len(trace) - 1) / span, summary["completed"] / duration
    if served >= 0.8 * offered or busy < 0.9 * duration:
        return None
    return (f"warning: the offered load ({offered:.3g} req/s) exceeds the simulated capacity (about "
            f"{summary['completed'] / busy:.3g} req/s; busy {100 * busy / duration:.0f}% of "
            f"{duration:.0f} s); requests queue for the whole trace, so its latencies grow with its length: "
            f"slow the arrivals (--time-scale, --request-rate) or add capacity")
