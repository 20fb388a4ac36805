"""Drive an ``LLMEngine`` from outside and record a per-step timeline: wall clock around each ``step()``,
``kv_cache_stats()`` after it, which requests received a token. Used by ``benchmarks.report`` and
``benchmarks.prefix``; times are ``time.monotonic()`` seconds, lengths tokens."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from kvserve.bench.workloads import BenchRequest
from kvserve.metrics import percentile

# ------------------------------------------------------------------------------------------------ timelines
@dataclass
class TimedRequest:
    """A request of a driven run: added once the run reaches ``at`` (seconds after the start when driving by
    time, a step index when driving by steps). Greedy, ``ignore_eos``, exactly ``output_len`` tokens."""

    request_id: str
    prompt_token_ids: list
    output_len: int
    at: float = 0.0


@dataclass
class StepRecord:
    """One engine step seen from outside (times in seconds since the run's start, sizes in tokens).

    Attributes:
        start_s, end_s: wall clock around ``step()``.
        num_scheduled: requests the step computed (``max_num_seqs`` bounds it); ``num_tokens``: tokens it computed.
        num_running, num_waiting: queue sizes after the step.
        used_blocks, tokens_stored, tokens_allocated, naive_reserved_tokens: ``kv_cache_stats()`` after the step.
        new_tokens: request id -> tokens it received in this step.
    """

    start_s: float
    end_s: float
    num_scheduled: int
    num_tokens: int
    num_running: int
    num_waiting: int
    used_blocks: int
    tokens_stored: int
    tokens_allocated: int
    naive_reserved_tokens: int
    new_tokens: dict = field(default_factory=dict)


@dataclass
class Timeline:
    """A driven run: its steps, when each request received each token, and its final outputs.

    Attributes:
        steps: ``StepRecord`` per step.
        token_times: request id -> end time (s since start) of the step that produced each of its tokens.
        arrival_s: request id -> when it was added (s since start; its scheduled arrival when driving by time).
        finished: request id -> final ``RequestOutput``.
        wall_s: start to the last request's finish.
    """

    steps: list
    token_times: dict
    arrival_s: dict
    finished: dict
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(len(v) for v in self.token_times.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft(self, request_id: str) -> float:
        """Seconds from the request's arrival to its first token."""
        return self.token_times[request_id][0] - self.arrival_s[request_id]

    def itl(self, request_ids) -> list:
        """Gaps (seconds) between consecutive tokens of each of ``request_ids``, all together."""
        gaps = []
        for rid in request_ids:
            t = self.token_times.get(rid, [])
            gaps.extend(b - a for a, b in zip(t, t[1:]))
        return gaps


def drive(engine, requests: list, by: str = "time", poll_s: float = 0.005) -> Timeline:
    """Run ``requests`` (``TimedRequest``) on ``engine`` until all finish, recording a ``Timeline``.

    Args:
        engine: an idle ``LLMEngine``.
        requests: what to add and when.
        by: ``"time"``: a request is added once ``at`` seconds have passed (the engine steps meanwhile and sleeps
            ``poll_s`` when idle), with ``arrival_time`` set to its scheduled arrival so TTFT includes the wait for
            a step in progress; ``"step"``: it is added just before step number ``at`` (0-based) runs.

    Raises:
        ValueError: ``by`` is neither ``"time"`` nor ``"step"``, or the engine rejects a request.
    """
    from kvserve.sampling_params import SamplingParams

    if by not in ("time", "step"):
        raise ValueError(f"by must be 'time' or 'step', got {by!r}")
    pending = sorted(requests, key=lambda r: r.at)
    steps: list = []
    token_times: dict = {r.request_id: [] for r in requests}
    arrival_s: dict = {}
    finished: dict = {}
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and (pending[0].at <= (now if by == "time" else len(steps))
                           or (by == "step" and not engine.has_unfinished_requests())):
            r = pending.pop(0)
            arrival = r.at if by == "time" else now
            sp = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(r.prompt_token_ids, sp, request_id=r.request_id, arrival_time=t0 + arrival)
            arrival_s[r.request_id] = arrival
        if not engine.has_unfinished_requests():
            time.sleep(min(poll_s, max(0.0, pending[0].at - (time.monotonic() - t0))))
            continue
        before = engine.stats
        running0, tokens0 = before.sum_running, before.num_computed_tokens_total
        start = time.monotonic()
        outs = engine.step()
        end = time.monotonic()
        kv = engine.kv_cache_stats()
        after = engine.stats
        rec = StepRecord(
            start - t0, end - t0, after.sum_running - running0, after.num_computed_tokens_total - tokens0,
            engine.scheduler.num_running, engine.scheduler.num_waiting, kv.used_blocks, kv.tokens_stored,
            kv.tokens_allocated, kv.naive_reserved_tokens,
        )
        for o in outs:
            n = len(o.outputs[0].delta_token_ids)
            if n:
                rec.new_tokens[o.request_id] = n
                token_times[o.request_id].extend([end - t0] * n)
            if o.finished:
                finished[o.request_id] = o
        steps.append(rec)
    last = max((v[-1] for v in token_times.values() if v), default=0.0)
    return Timeline(steps, token_times, arrival_s, finished, last)



def poisson_arrivals(requests: list, rate: float, seed: int = 0) -> list:
    """Copies of ``requests`` (``BenchRequest``) with Poisson arrivals at ``rate`` requests/s (exponential gaps,
    the first at 0); ``rate=inf`` puts every arrival at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(requests):
        if i and rate != float("inf"):
            t += rng.expovariate(rate)
        out.append(BenchRequest(r.prompt_token_ids, r.output_len, t))
    return out


def latency_summary(tl: Timeline) -> dict:
    """TTFT and TPOT p50/p99 (s), output tokens, tokens/s and wall time (s) of a driven run; TPOT per request is
    (last token - first token) / (output tokens - 1)."""
    ttft = [tl.ttft(rid) for rid, t in tl.token_times.items() if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in tl.token_times.values() if len(t) > 1]
    return {"p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
            "p50_tpot_s": percentile(tpot, 50), "p99_tpot_s": percentile(tpot, 99),
            "output_tokens": tl.output_tokens, "output_tokens_per_s": tl.output_tokens_per_s, "wall_s": tl.wall_s}


def rate_key(point: dict) -> float:
    """Sort key of a rate-sweep point: its request rate (req/s), ``inf`` for all-at-once."""
    return float("inf") if point["rate_req_s"] is None else point["rate_req_s"]
