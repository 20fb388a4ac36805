"""``kvserve bench report --out DIR``: the serving-behaviour report — fixed workloads on the real model, PNG plots
and a markdown summary (``DIR/report.md``, numbers also in ``DIR/report.json``).

Every run drives an ``LLMEngine`` directly and records a per-step timeline from outside the engine: wall-clock
time around each ``step()``, ``kv_cache_stats()`` after it, how many requests and tokens it scheduled (from
``engine.stats``) and which requests received a token. Four experiments:

1. KV memory over one run (continuous batching, skewed output lengths): naive reservation (prompt + max_tokens
   per running request) vs paged allocation vs tokens actually stored, and the waste of each.
2. Batch occupancy per step, static vs continuous batching, the same requests.
3. Inter-token latency (ITL) of running decodes while long prompts arrive, chunked vs unchunked prefill: p99 and
   max stall, throughput, and the long prompts' TTFT.
4. Throughput vs latency over a sweep of Poisson request rates (fractions of the capacity measured with every
   request arriving at once): TTFT and TPOT p50/p99 against output tokens/s.

All requests are greedy with ``ignore_eos`` and a fixed ``max_tokens``, so compared runs do identical work.
Times are seconds (``time.monotonic()``), lengths are tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from kvserve.bench.throughput import percentile
from kvserve.bench.workloads import SAFE_TOKEN_RANGE, BenchRequest, synthetic_skewed


# ------------------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class ReportConfig:
    """Sizes of the report's workloads (tokens, requests, steps). ``FULL`` takes ~10-15 min on a 2-core CPU,
    ``QUICK`` well under a minute.

    Attributes:
        kv_*: experiments 1 and 2: ``kv_num_requests`` synthetic requests (prompt lengths ``kv_input``, outputs
            ``kv_output_short`` or, with probability 1/4, ``kv_output_long``), ``kv_max_num_seqs`` at once, a
            token budget of ``kv_max_num_batched_tokens`` (room for a whole batch of prompts, so that static
            batching admits full batches).
        itl_*: experiment 3: ``itl_num_short`` requests of ``itl_short_prompt`` prompt tokens decoding
            ``itl_short_output`` tokens each, and one long prompt of ``itl_long_prompt`` tokens (generating
            ``itl_long_output``) added before each step index in ``itl_long_at_steps``; the chunked run uses a
            token budget of ``itl_chunk_budget``, the unchunked one ``itl_unchunked_budget``.
        sweep_*: experiment 4: ``sweep_num_requests`` requests per rate (prompts ``sweep_input``, outputs
            ``sweep_output``), rates = ``sweep_fractions`` x the all-at-once request throughput.
        block_size, num_kv_blocks: the pool of every engine.
    """

    kv_num_requests: int = 24
    kv_max_num_seqs: int = 8
    kv_max_num_batched_tokens: int = 2048
    kv_input: tuple = (32, 128)
    kv_output_short: tuple = (8, 32)
    kv_output_long: tuple = (64, 128)
    itl_num_short: int = 8
    itl_short_prompt: int = 32
    itl_short_output: int = 60
    itl_long_prompt: int = 2000
    itl_long_output: int = 8
    itl_long_at_steps: tuple = (5, 25)
    itl_chunk_budget: int = 256
    itl_unchunked_budget: int = 4096
    sweep_num_requests: int = 20
    sweep_max_num_seqs: int = 16
    sweep_input: tuple = (32, 96)
    sweep_output: tuple = (16, 32)
    sweep_fractions: tuple = (0.3, 0.6, 0.9)
    block_size: int = 16
    num_kv_blocks: int = 512


FULL = ReportConfig()
QUICK = ReportConfig(
    kv_num_requests=4, kv_max_num_seqs=2, kv_max_num_batched_tokens=256, kv_input=(16, 40), kv_output_short=(2, 4), kv_output_long=(6, 8),
    itl_num_short=2, itl_short_prompt=16, itl_short_output=8, itl_long_prompt=96, itl_long_output=2,
    itl_long_at_steps=(2,), itl_chunk_budget=32, itl_unchunked_budget=256,
    sweep_num_requests=3, sweep_max_num_seqs=4, sweep_input=(16, 32), sweep_output=(2, 3), sweep_fractions=(0.5,),
    num_kv_blocks=64,
)


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


def _random_prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(n)]


def _timed(requests: list, prefix: str) -> list:
    return [TimedRequest(f"{prefix}{i}", r.prompt_token_ids, r.output_len, r.arrival_s) for i, r in enumerate(requests)]


class _Engines:
    """Builds warmed-up engines that share one loaded model (``load_model`` caches it)."""

    def __init__(self, model: Optional[str], dtype: str, num_threads: Optional[int], cfg: ReportConfig, seed: int):
        self.base = {"model": model, "dtype": dtype, "num_threads": num_threads, "block_size": cfg.block_size,
                     "num_kv_blocks": cfg.num_kv_blocks}
        self.rng = random.Random(seed + 7919)

    def make(self, **scheduler_args):
        from kvserve import LLM, SamplingParams

        llm = LLM(**self.base, **scheduler_args)
        # warm-up on a fresh random prompt (nothing a workload could share through a prefix cache)
        llm.generate([_random_prompt(self.rng, 24)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        llm.llm_engine.reset_stats()
        return llm.llm_engine


# ------------------------------------------------------------------------------------------------ experiments
def kv_and_batching(engines: _Engines, cfg: ReportConfig, seed: int) -> tuple:
    """Experiments 1 and 2: the same skewed workload under continuous and static batching.

    Returns:
        ``(summary, {"continuous": Timeline, "static": Timeline})``; the summary holds KV waste (fractions 0..1)
        and peaks (tokens) of the continuous run, and steps, wall time (s), mean batch size and output tokens/s of
        both.
    """
    reqs = synthetic_skewed(cfg.kv_num_requests, seed, input_len=cfg.kv_input, short=cfg.kv_output_short,
                            long=cfg.kv_output_long)
    timelines = {}
    for policy in ("continuous", "static"):
        engine = engines.make(scheduling=policy, max_num_seqs=cfg.kv_max_num_seqs,
                              max_num_batched_tokens=cfg.kv_max_num_batched_tokens)
        timelines[policy] = drive(engine, _timed(reqs, f"{policy[0]}"), by="step")
    cont = timelines["continuous"].steps
    stored = sum(s.tokens_stored for s in cont)
    allocated = sum(s.tokens_allocated for s in cont)
    naive = sum(s.naive_reserved_tokens for s in cont)
    summary = {
        "num_requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
        "max_num_seqs": cfg.kv_max_num_seqs,
        "paged_waste": 1 - stored / allocated if allocated else 0.0,
        "naive_waste": 1 - stored / naive if naive else 0.0,
        "peak_stored_tokens": max(s.tokens_stored for s in cont),
        "peak_allocated_tokens": max(s.tokens_allocated for s in cont),
        "peak_naive_reserved_tokens": max(s.naive_reserved_tokens for s in cont),
        "runs": {
            policy: {
                "steps": len(tl.steps), "wall_s": tl.wall_s, "output_tokens": tl.output_tokens,
                "output_tokens_per_s": tl.output_tokens_per_s,
                "mean_batch_size": statistics.fmean(s.num_scheduled for s in tl.steps),
            }
            for policy, tl in timelines.items()
        },
    }
    return summary, timelines


def chunked_prefill_itl(engines: _Engines, cfg: ReportConfig, seed: int) -> tuple:
    """Experiment 3: short requests decoding while long prompts arrive (before the steps in
    ``cfg.itl_long_at_steps``), with and without chunked prefill.

    Returns:
        ``(summary, {"chunked": Timeline, "unchunked": Timeline})``; per mode the short requests' ITL p50/p99
        and max stall (s), output tokens/s, wall time (s), the long prompts' mean TTFT (s) and the most tokens
        any step computed; then ``p99_itl_ratio`` (unchunked / chunked), ``max_stall_ratio``,
        ``throughput_ratio`` (chunked / unchunked) and ``long_ttft_cost_s`` (chunked - unchunked).
    """
    rng = random.Random(seed + 1)
    reqs = [TimedRequest(f"short{i}", _random_prompt(rng, cfg.itl_short_prompt), cfg.itl_short_output, 0)
            for i in range(cfg.itl_num_short)]
    longs = [TimedRequest(f"long{i}", _random_prompt(rng, cfg.itl_long_prompt), cfg.itl_long_output, at)
             for i, at in enumerate(cfg.itl_long_at_steps)]
    short_ids = [r.request_id for r in reqs]
    modes = {
        "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": cfg.itl_chunk_budget},
        "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": cfg.itl_unchunked_budget},
    }
    timelines, summary = {}, {
        "num_short": cfg.itl_num_short, "short_prompt_tokens": cfg.itl_short_prompt,
        "short_output_tokens": cfg.itl_short_output, "long_prompt_tokens": cfg.itl_long_prompt,
        "long_arrival_steps": list(cfg.itl_long_at_steps),
    }
    for mode, args in modes.items():
        engine = engines.make(max_num_seqs=cfg.itl_num_short + len(longs), **args)
        tl = drive(engine, reqs + longs, by="step")
        timelines[mode] = tl
        gaps = tl.itl(short_ids)
        summary[mode] = {
            "max_num_batched_tokens": args["max_num_batched_tokens"],
            "p50_itl_s": percentile(gaps, 50), "p99_itl_s": percentile(gaps, 99), "max_stall_s": max(gaps),
            "mean_itl_s": statistics.fmean(gaps), "output_tokens": tl.output_tokens,
            "output_tokens_per_s": tl.output_tokens_per_s, "wall_s": tl.wall_s,
            "long_ttft_s": statistics.fmean(tl.ttft(r.request_id) for r in longs),
            "max_step_tokens": max(s.num_tokens for s in tl.steps), "steps": len(tl.steps),
        }
    c, u = summary["chunked"], summary["unchunked"]
    summary.update(
        p99_itl_ratio=u["p99_itl_s"] / c["p99_itl_s"], max_stall_ratio=u["max_stall_s"] / c["max_stall_s"],
        throughput_ratio=c["output_tokens_per_s"] / u["output_tokens_per_s"],
        long_ttft_cost_s=c["long_ttft_s"] - u["long_ttft_s"],
    )
    return summary, timelines


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


def rate_sweep(engines: _Engines, cfg: ReportConfig, seed: int) -> dict:
    """Experiment 4: every request at once (the capacity point), then Poisson arrivals at
    ``cfg.sweep_fractions`` x that request throughput. Each point uses fresh random prompts.

    Returns:
        ``{"max_num_seqs", "points": [...]}``, one point per rate (``rate_req_s`` in requests/s, ``None`` for all
        at once) with its ``latency_summary``.
    """
    points = []
    engine = engines.make(max_num_seqs=cfg.sweep_max_num_seqs)
    rates = [float("inf")]
    i = 0
    while i < len(rates):
        reqs = synthetic_skewed(cfg.sweep_num_requests, seed + 100 + i, input_len=cfg.sweep_input,
                                short=cfg.sweep_output, long_fraction=0.0)
        tl = drive(engine, _timed(poisson_arrivals(reqs, rates[i], seed + i), f"r{i}-"), by="time")
        rate = None if rates[i] == float("inf") else rates[i]
        points.append({"rate_req_s": rate, "num_requests": len(reqs), **latency_summary(tl)})
        if i == 0:
            capacity = len(reqs) / tl.wall_s
            rates += [f * capacity for f in sorted(cfg.sweep_fractions)]
        i += 1
    return {"max_num_seqs": cfg.sweep_max_num_seqs, "points": points}


def _rate_key(point: dict) -> float:
    return float("inf") if point["rate_req_s"] is None else point["rate_req_s"]


# ------------------------------------------------------------------------------------------------ plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_kv_memory(tl: Timeline, summary: dict, path: Path) -> None:
    """Experiment 1 figure: naive reserved vs paged allocated vs stored tokens per step."""
    plt = _pyplot()
    x = range(len(tl.steps))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(x, [s.naive_reserved_tokens for s in tl.steps], label="naive reservation (prompt + max_tokens)",
            color="tab:red")
    ax.plot(x, [s.tokens_allocated for s in tl.steps], label="paged: allocated (blocks x block_size)",
            color="tab:blue")
    ax.fill_between(x, [s.tokens_stored for s in tl.steps], color="tab:green", alpha=0.35,
                    label="actually used (tokens with K/V)")
    _style(ax, "engine step", "KV cache (tokens)")
    ax.set_title(f"KV memory, continuous batching: waste {summary['paged_waste']:.1%} paged vs "
                 f"{summary['naive_waste']:.1%} naive", fontsize=10)
    _save(plt, fig, path)


def plot_batch_occupancy(timelines: dict, summary: dict, path: Path) -> None:
    """Experiment 2 figure: requests computed per step, static vs continuous."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for policy, color in (("continuous", "tab:blue"), ("static", "tab:orange")):
        steps = timelines[policy].steps
        run = summary["runs"][policy]
        ax.step(range(len(steps)), [s.num_scheduled for s in steps], where="post", color=color,
                label=f"{policy}: {run['steps']} steps, mean batch {run['mean_batch_size']:.1f}")
    ax.axhline(summary["max_num_seqs"], color="gray", ls=":", label="max_num_seqs")
    _style(ax, "engine step", "requests in the batch")
    ax.set_title(f"Batch occupancy, {summary['num_requests']} requests with skewed output lengths", fontsize=10)
    _save(plt, fig, path)


def plot_itl(timelines: dict, summary: dict, path: Path) -> None:
    """Experiment 3 figure: each short request's inter-token gaps over time, unchunked above, chunked below, with
    the long prompts' arrivals (dashed) and first tokens (solid)."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True, sharey=True)
    for ax, mode, color in zip(axes, ("unchunked", "chunked"), ("tab:red", "tab:blue")):
        tl, s = timelines[mode], summary[mode]
        for rid, times in tl.token_times.items():
            if rid.startswith("short") and len(times) > 1:
                ax.plot(times[1:], [b - a for a, b in zip(times, times[1:])], ".", ms=3, color=color)
        for rid, times in tl.token_times.items():
            if rid.startswith("long"):
                ax.axvline(tl.arrival_s[rid], color="gray", ls="--", lw=1)
                if times:
                    ax.axvline(times[0], color="black", lw=1)
        ax.axhline(s["p99_itl_s"], color=color, ls=":", lw=1)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("ITL (s)")
        ax.set_title(f"{mode} (budget {s['max_num_batched_tokens']} tokens): p99 ITL {s['p99_itl_s']:.2f} s, "
                     f"max stall {s['max_stall_s']:.2f} s, {s['output_tokens_per_s']:.1f} tok/s, "
                     f"long-prompt TTFT {s['long_ttft_s']:.1f} s", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].set_xlabel("time since start (s); dashed: a long prompt arrives, solid: its first token")
    n_long = len(summary["long_arrival_steps"])
    fig.suptitle(f"{summary['num_short']} running decodes, {n_long} prompt{'s' if n_long > 1 else ''} of "
                 f"{summary['long_prompt_tokens']} tokens arriving: p99 ITL {summary['p99_itl_ratio']:.1f}x lower "
                 f"chunked", fontsize=10)
    _save(plt, fig, path)


def plot_throughput_latency(sweep: dict, path: Path) -> None:
    """Experiment 4 figure: TTFT and TPOT p50/p99 (ms) against output tokens/s, one point per request rate."""
    plt = _pyplot()
    pts = sorted(sweep["points"], key=_rate_key)
    x = [p["output_tokens_per_s"] for p in pts]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [p[f"{q}_{metric}_s"] * 1000 for p in pts], style, label=f"{metric.upper()} {q}")
        for p, xi in zip(pts, x):
            rate = "all at once" if p["rate_req_s"] is None else f"{p['rate_req_s']:.2f} req/s"
            ax.annotate(rate, (xi, p[f"p99_{metric}_s"] * 1000), fontsize=7, textcoords="offset points",
                        xytext=(3, 4))
        _style(ax, "output throughput (tokens/s)", f"{metric.upper()} (ms)")
    fig.suptitle(f"Throughput vs latency, Poisson arrivals ({pts[0]['num_requests']} requests per rate, "
                 f"max_num_seqs {sweep['max_num_seqs']})", fontsize=10)
    _save(plt, fig, path)


# ------------------------------------------------------------------------------------------------ markdown
def render_markdown(summary: dict) -> str:
    """``report.md``: the four figures with their numbers (``summary`` as returned by ``run_report``)."""
    kv, itl, sw = summary["kv"], summary["itl"], summary["sweep"]
    c, u = itl["chunked"], itl["unchunked"]
    ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    lines = [
        "# kvserve serving-behaviour report",
        "",
        f"`{summary['command']}` — SmolLM2-135M-Instruct ({summary['dtype']}) on {summary['cpus']} CPU cores "
        f"({summary['num_threads']} torch thread{'s' if summary['num_threads'] > 1 else ''}), "
        f"{summary['total_s']:.0f} s in all. Greedy, `ignore_eos`, fixed output lengths. Wall-clock numbers are "
        "noisy on a shared machine; the ratios compare runs made side by side.",
        "",
        "## 1. KV memory over one run",
        "",
        "![KV memory](kv_memory.png)",
        "",
        f"{kv['num_requests']} requests ({kv['prompt_tokens']} prompt / {kv['output_tokens']} output tokens), "
        f"continuous batching, `max_num_seqs` {kv['max_num_seqs']}. Waste = unused / reserved slots, summed over "
        "steps:",
        "",
        "| | tokens at peak | waste |",
        "|---|---:|---:|",
        f"| naive reservation (prompt + max_tokens per running request) | {kv['peak_naive_reserved_tokens']} | "
        f"{kv['naive_waste']:.1%} |",
        f"| paged (allocated blocks) | {kv['peak_allocated_tokens']} | {kv['paged_waste']:.1%} |",
        f"| actually used | {kv['peak_stored_tokens']} | |",
        "",
        "## 2. Batch occupancy: static vs continuous",
        "",
        "![Batch occupancy](batch_occupancy.png)",
        "",
        "| scheduling | steps | mean batch | wall s | output tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy, r in kv["runs"].items():
        lines.append(f"| {policy} | {r['steps']} | {r['mean_batch_size']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['output_tokens_per_s']:.1f} |")
    lines += [
        "",
        "## 3. Inter-token latency while long prompts arrive: chunked vs unchunked prefill",
        "",
        "![ITL](itl_chunked_prefill.png)",
        "",
        f"{itl['num_short']} requests ({itl['short_prompt_tokens']}-token prompts) decode "
        f"{itl['short_output_tokens']} tokens each; a {itl['long_prompt_tokens']}-token prompt arrives before "
        f"step{'s' if len(itl['long_arrival_steps']) > 1 else ''} "
        f"{', '.join(str(s) for s in itl['long_arrival_steps'])}. ITL = gap between consecutive tokens of the "
        "short requests.",
        "",
        "| prefill | token budget | ITL p50 ms | ITL p99 ms | max stall ms | output tok/s | long-prompt TTFT s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in (("unchunked", u), ("chunked", c)):
        lines.append(f"| {mode} | {r['max_num_batched_tokens']} | {ms(r['p50_itl_s'])} | {ms(r['p99_itl_s'])} | "
                     f"{ms(r['max_stall_s'])} | {r['output_tokens_per_s']:.1f} | {r['long_ttft_s']:.1f} |")
    def target(ok: bool, what: str) -> str:  # the targets apply to the full-size workload only
        return "" if summary["quick"] else f" (target {what}: {'met' if ok else '**not met**'})"

    lines += [
        "",
        f"- p99 ITL **{itl['p99_itl_ratio']:.1f}x lower** with chunked prefill"
        f"{target(itl['p99_itl_ratio'] >= 3, '>= 3x')}; max stall {itl['max_stall_ratio']:.1f}x lower.",
        f"- Throughput chunked / unchunked = **{itl['throughput_ratio']:.2f}**"
        f"{target(itl['throughput_ratio'] >= 0.9, 'within 10%')}.",
        f"- Long-prompt TTFT, chunked - unchunked: {itl['long_ttft_cost_s']:+.1f} s "
        f"({c['long_ttft_s']:.1f} s vs {u['long_ttft_s']:.1f} s).",
        f"- Median ITL is {ms(c['p50_itl_s'])} ms chunked vs {ms(u['p50_itl_s'])} ms unchunked: chunking spreads "
        "each prefill over many steps that all carry the decodes, instead of one long stall.",
        "",
        "## 4. Throughput vs latency over request rates",
        "",
        "![Throughput vs latency](throughput_latency.png)",
        "",
        "| rate req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(sw["points"], key=_rate_key):
        rate = "all at once" if p["rate_req_s"] is None else f"{p['rate_req_s']:.2f}"
        lines.append(f"| {rate} | {p['output_tokens_per_s']:.1f} | {ms(p['p50_ttft_s'])} | {ms(p['p99_ttft_s'])} | "
                     f"{ms(p['p50_tpot_s'])} | {ms(p['p99_tpot_s'])} |")
    lines += ["", "Rates are fractions of the request throughput measured with every request arriving at once.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry points
def run_report(out_dir, quick: bool = False, model: Optional[str] = None, dtype: str = "float32",
               num_threads: Optional[int] = None, seed: int = 0, command: str = "kvserve bench report") -> dict:
    """Run the four experiments and write ``kv_memory.png``, ``batch_occupancy.png``, ``itl_chunked_prefill.png``,
    ``throughput_latency.png``, ``report.md`` and ``report.json`` into ``out_dir`` (created if missing).

    Args:
        quick: the tiny ``QUICK`` workloads (for tests) instead of ``FULL``.

    Returns:
        the summary written to ``report.json`` (keys ``kv``, ``itl``, ``sweep``, ``files``, ``total_s``, ...).
    """
    import torch

    cfg = QUICK if quick else FULL
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    engines = _Engines(model, dtype, num_threads, cfg, seed)
    kv, kv_tl = kv_and_batching(engines, cfg, seed)
    plot_kv_memory(kv_tl["continuous"], kv, out / "kv_memory.png")
    plot_batch_occupancy(kv_tl, kv, out / "batch_occupancy.png")
    itl, itl_tl = chunked_prefill_itl(engines, cfg, seed)
    plot_itl(itl_tl, itl, out / "itl_chunked_prefill.png")
    sweep = rate_sweep(engines, cfg, seed)
    plot_throughput_latency(sweep, out / "throughput_latency.png")
    summary = {
        "command": command, "quick": quick, "dtype": dtype, "cpus": os.cpu_count(), "seed": seed,
        "num_threads": torch.get_num_threads(),
        "config": asdict(cfg), "kv": kv, "itl": itl, "sweep": sweep, "total_s": time.monotonic() - t0,
        "files": ["kv_memory.png", "batch_occupancy.png", "itl_chunked_prefill.png", "throughput_latency.png"],
    }
    (out / "report.md").write_text(render_markdown(summary), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary


def add_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``kvserve bench report``."""
    p.add_argument("--out", required=True, help="directory for the PNGs, report.md and report.json")
    p.add_argument("--quick", action="store_true", help="tiny workloads (seconds, for tests), not the ~10-15 min run")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """``kvserve bench report``: run, print the headline numbers and where the files are."""
    command = "kvserve bench report --out " + str(args.out) + (" --quick" if args.quick else "")
    if args.num_threads:
        command += f" --num-threads {args.num_threads}"
    s = run_report(args.out, args.quick, args.model, args.dtype, args.num_threads, args.seed, command)
    itl, kv = s["itl"], s["kv"]
    print(f"KV waste: paged {kv['paged_waste']:.1%}, naive reservation {kv['naive_waste']:.1%}")
    print(f"p99 ITL: unchunked {itl['unchunked']['p99_itl_s'] * 1000:.0f} ms, chunked "
          f"{itl['chunked']['p99_itl_s'] * 1000:.0f} ms ({itl['p99_itl_ratio']:.1f}x); max stall "
          f"{itl['unchunked']['max_stall_s']:.2f} s vs {itl['chunked']['max_stall_s']:.2f} s; throughput ratio "
          f"{itl['throughput_ratio']:.2f}")
    print(f"wrote {Path(args.out) / 'report.md'} ({s['total_s']:.0f} s)")
    return 0
