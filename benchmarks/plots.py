"""The report's figures (matplotlib, Agg backend): KV memory, batch occupancy, ITL, throughput vs latency."""

from __future__ import annotations

from pathlib import Path

from benchmarks.driver import Timeline, rate_key
from kvserve.sim.plots import pyplot as _pyplot
from kvserve.sim.plots import save as _save
from kvserve.sim.plots import style as _style


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
    pts = sorted(sweep["points"], key=rate_key)
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
