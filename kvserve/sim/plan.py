"""``kvserve plan``: search engine settings with the simulator for the highest goodput under SLOs.

For each setting of the grid (``max_num_seqs`` x ``max_num_batched_tokens`` x ``block_size`` x KV pool size x
chunked prefill x scheduling policy) the trace is simulated at the target request rate (``--request-rate``,
Poisson arrivals; or the trace's own arrivals) and scored by goodput (requests/s meeting every SLO). A setting
*meets* the SLOs when at least ``--attainment`` (default 90%) of the requests meet all of them and none is
rejected or cut short (a setting whose token budget, without chunked prefill, ends requests before their
``output_len``: the engine caps a sequence at the budget); ties on goodput go to the setting with the smaller sum of p99 / SLO over the SLO metrics. The planner prints the best setting, the next-best ones, and, for the top settings, the knee: the
highest rate of a geometric sweep at which the SLOs still hold; with ``--plot`` it draws goodput against rate per
setting.

Raises ``ValueError`` with "no setting meets ..." and the best attainment found when nothing meets the SLOs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

from kvserve.engine.arg_utils import engine_kwargs
from kvserve.extras import require
from kvserve.metrics import parse_goodput, summarize
from kvserve.sim import trace as tr


def _ints(text: str, name: str) -> list:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--{name} takes integers >= 1, got {text!r}")
    return vals


def add_args(p: argparse.ArgumentParser) -> None:
    from kvserve.engine.arg_utils import add_engine_args
    from kvserve.sim.cli import add_trace_args

    add_engine_args(p, skip=("device", "speculative_config", "max_num_seqs", "max_num_batched_tokens", "block_size",
                             "num_kv_blocks", "enable_chunked_prefill", "scheduling_policy"))
    add_trace_args(p)
    p.add_argument("--profile", default="profile.json")
    p.add_argument("--slo", nargs="+", required=True, metavar="METRIC:MS", help="e.g. ttft:500 tpot:100")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet every SLO")
    p.add_argument("--max-num-seqs", default="8,16,32,64", help="comma list of max_num_seqs to try")
    p.add_argument("--max-num-batched-tokens", default="256,512,1024",
                   help="comma list of per-step token budgets to try")
    p.add_argument("--block-size", default="16", help="comma list of block sizes (tokens) to try")
    p.add_argument("--num-kv-blocks", default="2048", help="comma list of KV pool sizes to try (blocks)")
    p.add_argument("--chunked-prefill", default="on,off", help="comma list of on / off to try")
    p.add_argument("--scheduling-policy", default="fcfs", help="comma list of fcfs / priority to try")
    p.add_argument("--top", type=int, default=3, help="settings to sweep for the knee and list")
    p.add_argument("--plot", default=None, help="write goodput vs rate per setting to this PNG")
    p.add_argument("--output-json", default=None)


def grid(args) -> list:
    """The settings to try, as engine-argument dicts."""
    chunked = []
    for x in args.chunked_prefill.split(","):
        if x.strip() not in ("on", "off"):
            raise ValueError(f"--chunked-prefill takes on and/or off, got {args.chunked_prefill!r}")
        chunked.append(x.strip() == "on")
    policies = [x.strip() for x in args.scheduling_policy.split(",") if x.strip()]
    out = []
    for seqs, budget, bs, blocks, ch, pol in itertools.product(
            _ints(args.max_num_seqs, "max-num-seqs"), _ints(args.max_num_batched_tokens, "max-num-batched-tokens"),
            _ints(args.block_size, "block-size"), _ints(args.num_kv_blocks, "num-kv-blocks"), chunked, policies):
        out.append({"max_num_seqs": seqs, "max_num_batched_tokens": budget, "block_size": bs, "num_kv_blocks": blocks,
                    "enable_chunked_prefill": ch, "scheduling_policy": pol})
    return out


def describe(setting: dict) -> str:
    return (f"max_num_seqs={setting['max_num_seqs']} max_num_batched_tokens={setting['max_num_batched_tokens']} "
            f"block_size={setting['block_size']} num_kv_blocks={setting['num_kv_blocks']} "
            f"chunked_prefill={'on' if setting['enable_chunked_prefill'] else 'off'} "
            f"policy={setting['scheduling_policy']}")


def evaluate(base_args: dict, setting: dict, profile: str, trace: list, slos: dict) -> dict:
    """Simulate ``trace`` under ``setting``; returns goodput, attainment and the summary."""
    from kvserve.sim.cli import build_simulator

    sim, _ = build_simulator({**base_args, **setting}, profile)
    res = sim.run(trace, slos)
    s = res.summary
    if s["truncated"]:  # a request cut short did not get what it asked for: it meets no SLO here
        for r, got in zip(trace, res.results):
            if sim.cut_short(r, got):
                got.success, got.error = False, f"cut short at {got.output_tokens} of {r.output_len} tokens"
        s = {**s, **summarize(res.results, s["duration_s"], slos)}
    n = len(trace)
    attained = s["goodput"] * s["duration_s"] / n if s["duration_s"] > 0 else 0.0
    return {"goodput": s["goodput"], "attainment": attained, "rejected": s["rejected"], "truncated": s["truncated"],
            "summary": s}


def _clean(ev: dict) -> bool:
    """Nothing rejected and nothing cut short."""
    return ev["rejected"] == 0 and ev["truncated"] == 0


def _retimed(trace: list, rate: float, seed: int) -> list:
    out = [tr.TraceRequest(r.arrival_s, r.prompt_len, r.output_len, r.prefix_ids, r.prefix_block_tokens, r.priority,
                           r.token_ids) for r in trace]
    tr.poisson_arrivals(out, rate, seed)
    return out


def run(args: argparse.Namespace) -> int:
    """``kvserve plan``."""
    from kvserve.sim.cli import load_trace

    slos = parse_goodput(args.slo, "--slo")
    if not slos:
        raise ValueError("--slo needs at least one METRIC:MS")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.plot:  # before the search: the plot is drawn from the rate sweep, with matplotlib
        if args.request_rate is None or not math.isfinite(args.request_rate):
            raise ValueError("--plot draws goodput against rate around --request-rate: give a finite --request-rate")
        require("matplotlib", "bench", "kvserve plan --plot")
    grid_keys = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "enable_chunked_prefill",
                 "scheduling_policy")
    base = {k: v for k, v in engine_kwargs(args).items() if k not in ("device", "speculative_config", *grid_keys)}
    trace = load_trace(args)
    rate = args.request_rate
    settings = grid(args)
    scored = []
    for st in settings:
        ev = evaluate(base, st, args.profile, trace, slos)
        ev["setting"] = st
        ev["meets"] = ev["attainment"] >= args.attainment and _clean(ev)
        scored.append(ev)
    def margin(e: dict) -> float:  # ties on goodput: the setting with more room under the SLOs (p99 / SLO) first
        s = e["summary"]
        return -sum((s.get(f"p99_{k}_ms") or math.inf) / (v * 1000) for k, v in slos.items())

    scored.sort(key=lambda e: (e["meets"], _clean(e), round(e["goodput"], 9), e["attainment"], margin(e)),
                reverse=True)  # when nothing meets the SLOs, the best named is one that serves every request in full
    slo_text = " and ".join(f"{k} <= {v * 1000:g} ms" for k, v in slos.items())
    at = f"{rate:g} req/s" if rate else "the trace's arrival rate"
    best = scored[0]
    if not best["meets"]:
        raise ValueError(f"no setting meets {slo_text} for {100 * args.attainment:g}% of requests at {at}; best was "
                         f"{describe(best['setting'])} with {100 * best['attainment']:.1f}% of requests meeting every "
                         f"SLO (goodput {best['goodput']:.3f} req/s, {best['rejected']} rejected, {best['truncated']} "
                         f"cut short; a setting that rejects or cuts short any request cannot meet the SLOs)")
    print(f"{len(settings)} settings simulated on {len(trace)} requests at {at}; SLOs: {slo_text} "
          f"for >= {100 * args.attainment:g}% of requests")
    print(f"best: {describe(best['setting'])}")
    print(f"      goodput {best['goodput']:.3f} req/s, attainment {100 * best['attainment']:.1f}%, "
          f"TTFT p50/p99 {best['summary']['median_ttft_ms']:.0f}/{best['summary']['p99_ttft_ms']:.0f} ms, "
          f"TPOT p50/p99 {best['summary']['median_tpot_ms']:.0f}/{best['summary']['p99_tpot_ms']:.0f} ms")
    top = [e for e in scored if e["meets"]][: args.top]
    for e in top[1:]:
        print(f"next: {describe(e['setting'])}: goodput {e['goodput']:.3f} req/s, "
              f"attainment {100 * e['attainment']:.1f}%")
    knees, curves = [], {}
    if rate and math.isfinite(rate):
        rates = [rate * 2 ** (k / 2) for k in range(-2, 7)]
        for e in top:
            pts, knee = [], None
            for r in rates:
                ev = evaluate(base, e["setting"], args.profile, _retimed(trace, r, args.seed), slos)
                pts.append((r, ev["goodput"], ev["attainment"]))
                if ev["attainment"] >= args.attainment and _clean(ev) and \
                        knee == (pts[-2][0] if len(pts) > 1 else None):
                    knee = r  # the last rate of the unbroken run of passing rates from the lowest
            curves[describe(e["setting"])] = pts
            knees.append(knee)
            print(f"knee: {describe(e['setting'])}: SLOs hold up to ~{knee:.3g} req/s" if knee else
                  f"knee: {describe(e['setting'])}: SLOs fail at every swept rate")
        if args.plot:
            _plot(curves, args.plot, slo_text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"slos_ms": {k: v * 1000 for k, v in slos.items()}, "rate": rate,
                       "ranked": [{k: v for k, v in e.items() if k != "summary"} for e in scored],
                       "knees": knees, "curves": curves}, f, indent=1)
    return 0


def _plot(curves: dict, path: str, title: str) -> None:
    from kvserve.sim.plots import pyplot

    plt = pyplot()  # names the extra when matplotlib is missing
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name.replace(" block_size", "\nblock_size"))
    lo = min(p[0] for pts in curves.values() for p in pts)
    hi = max(p[0] for pts in curves.values() for p in pts)
    ax.plot([lo, hi], [lo, hi], ls=":", c="gray", label="offered rate")
    ax.set_xscale("log")
    rates = sorted({p[0] for pts in curves.values() for p in pts})
    if len(rates) <= 10:  # label the swept rates themselves; the log axis' minor labels (3x10^-1 ...) overlap
        ax.set_xticks(rates)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"simulated goodput, SLOs {title}", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
