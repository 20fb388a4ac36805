"""``kvserve sim`` (simulate a trace) and ``kvserve sim profile`` (measure the cost model): argument parsing and
printing only; the work is in ``trace``, ``simulator``, ``profile``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from kvserve.bench.workloads import default_data_dir
from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
from kvserve.metrics import format_table, parse_goodput
from kvserve.sim import trace as tr

DATASETS = ("azure", "mooncake", "sharegpt", "jsonl", "bench")


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--dataset", choices=DATASETS, default="azure")
    g.add_argument("--trace-file", default=None,
                   help="the trace file (default for azure / mooncake / sharegpt: the one in --data-dir; bench: a "
                        "`kvserve bench serve --output-json` report, its requests replayed at their send offsets)")
    g.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    g.add_argument("--azure-kind", choices=["conv", "code"], default="conv")
    g.add_argument("--mooncake-kind", choices=["conversation", "synthetic"], default="conversation")
    g.add_argument("--num-requests", type=int, default=1000, help="requests from the trace (from --start)")
    g.add_argument("--start", type=int, default=0, help="first trace row (0-based)")
    g.add_argument("--length-scale", type=float, default=1.0, help="divide token counts by this")
    g.add_argument("--max-input-len", type=int, default=None, help="cap on prompt tokens (after scaling)")
    g.add_argument("--max-output-len", type=int, default=None, help="cap on output tokens (after scaling)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival offsets by this")
    g.add_argument("--request-rate", type=float, default=None,
                   help="replace the trace's arrivals by a Poisson process at this rate (req/s; inf = all at once)")
    g.add_argument("--sharegpt-output-len", type=int, default=64, help="sharegpt: output tokens per request")
    g.add_argument("--prefix-block-tokens", type=int, default=512, help="jsonl: tokens per prefix_block_ids entry")
    g.add_argument("--seed", type=int, default=0)


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, skip=("device", "speculative_config"))
    add_trace_args(p)
    p.add_argument("--profile", default="profile.json", help="cost-model profile from `kvserve sim profile`")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 (metrics: ttft, tpot, e2el; ms)")
    p.add_argument("--output-json", default=None, help="write the summary (and KV usage over time) here")
    p.add_argument("--plot-dir", default=None,
                   help="write kv_usage.png (KV usage, running and waiting over time) and latency_cdf.png here")
    p.add_argument("--quiet", action="store_true")
    from kvserve.sim import cluster

    cluster.add_args(p)


def plot(res, out_dir) -> list:
    """Two figures of a simulated run (``kvserve.sim.plots``): KV usage with running / waiting
    requests over simulated time, and the CDFs of TTFT and TPOT. Returns the paths written."""
    from kvserve.sim.plots import pyplot, save, style

    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = [x[0] for x in res.kv_usage]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(t, [100 * x[1] for x in res.kv_usage], color="tab:blue", label="KV blocks in use (%)")
    ax2 = ax.twinx()
    ax2.plot(t, [x[2] for x in res.kv_usage], color="tab:green", lw=0.8, label="running")
    ax2.plot(t, [x[3] for x in res.kv_usage], color="tab:red", lw=0.8, label="waiting")
    ax2.set_ylabel("requests")
    ax2.legend(fontsize=8, loc="upper right")
    style(ax, "simulated time (s)", "KV usage (%)")
    ax.legend(fontsize=8, loc="upper left")
    s = res.summary
    ax.set_title(f"simulated KV usage: mean {100 * s['kv_usage_mean']:.1f}%, max {100 * s['kv_usage_max']:.1f}% of "
                 f"{s['num_blocks']} blocks; {s['preemptions']} preemptions", fontsize=10)
    paths = [out / "kv_usage.png", out / "latency_cdf.png"]
    save(plt, fig, paths[0])
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ok = [r for r in res.results if r.success]
    for name, vals in (("TTFT", [r.ttft for r in ok]), ("TPOT", [r.tpot for r in ok if r.tpot is not None])):
        v = sorted(1000 * x for x in vals)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xscale("log")
    style(ax, "latency (ms)", "fraction of requests")
    ax.set_title("simulated latency CDFs", fontsize=10)
    save(plt, fig, paths[1])
    return paths


def add_profile_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, skip=("device", "speculative_config", "max_num_seqs", "enable_prefix_caching",
                             "enable_chunked_prefill", "scheduling", "scheduling_policy"))
    p.add_argument("--output", default="profile.json", help="where to write the profile")
    p.add_argument("--quick", action="store_true", help="a smaller plan (tests)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of unrecorded steps before the plan (default 10; 0 with --quick): a fresh "
                        "process's first seconds can be much slower than the rest")


def load_trace(args) -> list:
    """The trace the arguments describe (``TraceRequest`` list), arrivals scaled or replaced.

    Raises:
        ValueError: bad counts, scales or files (the readers name the line and field).
    """
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if not (args.length_scale > 0 and math.isfinite(args.length_scale)):
        raise ValueError(f"--length-scale must be > 0, got {args.length_scale}")
    if not args.time_scale >= 0:
        raise ValueError(f"--time-scale must be >= 0, got {args.time_scale}")
    data = Path(args.data_dir) if args.data_dir else default_data_dir()
    if args.dataset in ("azure", "mooncake", "sharegpt") and not args.trace_file and not data.is_dir():
        raise ValueError(f"data folder not found: {str(data)!r} (the {args.dataset} trace is read from there); pass "
                         f"--data-dir (the folder holding azure_llm_2023/, mooncake/, sharegpt/) or --trace-file")
    caps = dict(max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    if args.dataset == "azure":
        path = args.trace_file or data / "azure_llm_2023" / f"AzureLLMInferenceTrace_{args.azure_kind}.csv"
        trace = tr.read_azure(path, args.num_requests, args.start, args.length_scale, **caps)
    elif args.dataset == "mooncake":
        path = args.trace_file or data / "mooncake" / f"{args.mooncake_kind}_trace.jsonl"
        trace = tr.read_mooncake(path, args.num_requests, args.start, args.length_scale, **caps)
    elif args.dataset == "sharegpt":
        path = args.trace_file or data / "sharegpt" / "ShareGPT_V3_filtered_1000.json"
        trace = tr.read_sharegpt(path, args.num_requests, args.sharegpt_output_len, args.seed,
                                 max_input_len=args.max_input_len)
    elif args.dataset == "bench":
        if not args.trace_file:
            raise ValueError("--dataset bench needs --trace-file (a `kvserve bench serve --output-json` report)")
        try:
            records = json.loads(Path(args.trace_file).read_text())["requests"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--trace-file {args.trace_file}: not a bench serve report with 'requests' "
                             f"({e})") from None
        trace = tr.read_bench_records(records)[args.start:args.start + args.num_requests]
    else:
        if not args.trace_file:
            raise ValueError("--dataset jsonl needs --trace-file")
        trace = tr.read_jsonl(args.trace_file, args.num_requests, args.start, args.prefix_block_tokens)
    if args.request_rate is not None:
        tr.poisson_arrivals(trace, args.request_rate, args.seed)
    elif args.time_scale != 1.0:
        for r in trace:
            r.arrival_s *= args.time_scale
    return trace


def build_simulator(engine_args: dict, profile_path):
    """A ``Simulator`` for these engine arguments and this profile. Its KV pool: ``num_kv_blocks`` or
    ``kv_cache_memory_bytes`` when given, else the profiled engine's pool (the profile's ``kv_cache_memory_bytes``,
    re-cut into blocks of this ``block_size``), else (profiles made before that field) the engine's default share of
    this machine's free RAM.

    Raises:
        ValueError: bad engine arguments, or a profile that is missing, malformed or of another model.
    """
    from kvserve.sim.profile import load
    from kvserve.sim.simulator import Simulator

    config = EngineConfig.from_kwargs(**{k: v for k, v in engine_args.items() if k not in ("device",)})
    model_name = None
    if config.model_config.model is not None:
        model_name = Path(config.model_config.model).name
    else:
        try:
            from kvserve.model.loader import default_model_path

            model_name = default_model_path().name
        except ValueError:
            model_name = None
    prof, cost = load(profile_path, model_name)
    bytes_per_block = int(prof["kv_bytes_per_token"]) * config.cache_config.block_size
    if config.model_config.dtype != prof.get("dtype", config.model_config.dtype):
        raise ValueError(f"{profile_path}: profile field 'dtype' is {prof['dtype']!r}, the run asks for "
                         f"{config.model_config.dtype!r}")
    field = "kv_cache_dtype" if "kv_cache_dtype" in prof else "dtype"  # profiles before the field: the model's
    prof_kv = prof.get(field, "float32")
    # "auto" is whatever the profiled engine resolved it to (it depends on the weights: the engine's own rule)
    run_kv = prof_kv if config.cache_config.kv_cache_dtype == "auto" else config.cache_config.kv_cache_dtype
    if run_kv != prof_kv:  # another cache type reads other bytes per step: the profile's step costs do not apply
        raise ValueError(f"{profile_path}: profile field {field!r} is {prof_kv!r} (the KV cache it was measured "
                         f"over), the run asks for kv_cache_dtype {run_kv!r}; make a profile with "
                         f"--kv-cache-dtype {run_kv}")
    cc = config.cache_config
    if cc.num_kv_blocks is None and cc.kv_cache_memory_bytes is None and prof.get("kv_cache_memory_bytes"):
        cc = dataclasses.replace(cc, kv_cache_memory_bytes=prof["kv_cache_memory_bytes"])  # the profiled machine's
    num_blocks = cc.resolve_num_blocks(bytes_per_block)
    return Simulator(config, cost, num_blocks, int(prof["max_position_embeddings"])), prof


def run(args: argparse.Namespace) -> int:
    """``kvserve sim``: returns 0 (1 when some requests were rejected)."""
    slos = parse_goodput(args.goodput)
    sim, prof = build_simulator(engine_kwargs(args), args.profile)
    trace = load_trace(args)
    from kvserve.sim import cluster
    from kvserve.sim.simulator import overload_warning

    if cluster.wants_cluster(args):
        return cluster.run_cli(args, sim, trace, slos)
    res = sim.run(trace, slos, sample_every=max(1, len(trace) // 200))
    s = res.summary
    warning = overload_warning(trace, s)
    if warning:
        print(warning, file=sys.stderr)
    if not args.quiet:
        print(f"simulated {len(trace)} requests ({args.dataset}) with profile {args.profile} "
              f"({prof['model']}, {prof.get('created', '?')}, KV cache {prof.get('kv_cache_dtype', 'float32')}) in "
              f"{s['sim_wall_s']:.1f} s wall")
        print(format_table(s))
        print(f"{'steps / preemptions':<40}  {s['steps']} / {s['preemptions']}")
        print(f"{'KV usage mean / max':<40}  {100 * s['kv_usage_mean']:.1f}% / {100 * s['kv_usage_max']:.1f}% "
              f"of {s['num_blocks']} blocks")
        if s["rejected"]:
            print(f"{'rejected (HTTP 400 on a server)':<40}  {s['rejected']}")
        if s["truncated"]:
            print(f"{'cut short (finish_reason length)':<40}  {s['truncated']} (a sequence may not outgrow the "
                  f"unchunked token budget)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": s, "kv_usage": res.kv_usage}, f, indent=1)
    if args.plot_dir:
        for path in plot(res, args.plot_dir):
            print(f"wrote {path}")
    return 1 if s["failed"] else 0


def run_profile(args: argparse.Namespace) -> int:
    """``kvserve sim profile``: measure, fit, save, print the fit."""
    from kvserve.sim.cost_model import FEATURE_UNITS
    from kvserve.sim.profile import WARMUP_S, check_warmup_s, measure, save

    warmup_s = check_warmup_s(args.warmup_s if args.warmup_s is not None else (0.0 if args.quick else WARMUP_S))
    prof = measure(engine_kwargs(args), quick=args.quick, warmup_s=warmup_s)
    save(prof, args.output)
    cm, fit = prof["cost_model"], prof["fit"]
    print(f"profile of {prof['model']} ({len(prof['samples'])} steps) written to {args.output}")
    print(f"step_s = {cm['intercept_s'] * 1000:.2f} ms + " +
          " + ".join(f"{v * 1000:.4g} ms x {k}{FEATURE_UNITS.get(k, '')}" for k, v in cm["coef_s"].items()))
    print(f"fit: mean |error| {100 * fit['mean_abs_rel_err']:.1f}%, max {100 * fit['max_abs_rel_err']:.1f}%",
          file=sys.stdout)
    return 0
