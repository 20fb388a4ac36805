"""``python -m benchmarks.report --out DIR``: the serving-behaviour report — fixed workloads on the real model, PNG plots
and a markdown summary (``DIR/report.md``, numbers also in ``DIR/report.json``).

The report (experiments, ``report.md``, ``report.json``); the driver is ``benchmarks.driver``, the figures
``benchmarks.plots``. Every run drives an ``LLMEngine`` directly and records a per-step timeline from outside the engine: wall-clock
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from benchmarks.driver import TimedRequest, drive, latency_summary, poisson_arrivals, rate_key
from benchmarks.plots import plot_batch_occupancy, plot_itl, plot_kv_memory, plot_throughput_latency
from kvserve.bench.workloads import SAFE_TOKEN_RANGE, synthetic_skewed
from kvserve.metrics import percentile


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
    for p in sorted(sw["points"], key=rate_key):
        rate = "all at once" if p["rate_req_s"] is None else f"{p['rate_req_s']:.2f}"
        lines.append(f"| {rate} | {p['output_tokens_per_s']:.1f} | {ms(p['p50_ttft_s'])} | {ms(p['p99_ttft_s'])} | "
                     f"{ms(p['p50_tpot_s'])} | {ms(p['p99_tpot_s'])} |")
    lines += ["", "Rates are fractions of the request throughput measured with every request arriving at once.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry points
def run_report(out_dir, quick: bool = False, model: Optional[str] = None, dtype: str = "float32",
               num_threads: Optional[int] = None, seed: int = 0, command: str = "python -m benchmarks.report") -> dict:
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
    """Arguments of ``python -m benchmarks.report``."""
    p.add_argument("--out", required=True, help="directory for the PNGs, report.md and report.json")
    p.add_argument("--quick", action="store_true", help="tiny workloads (seconds, for tests), not the ~10-15 min run")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """``python -m benchmarks.report``: run, print the headline numbers and where the files are."""
    command = "python -m benchmarks.report --out " + str(args.out) + (" --quick" if args.quick else "")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
