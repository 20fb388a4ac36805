"""``kvserve`` command line (dispatch only; engine flags come from ``kvserve.engine.arg_utils``): ``kvserve generate`` (the main job), ``kvserve serve`` (the HTTP server), and
``kvserve bench throughput`` / ``kvserve bench serve`` / ``kvserve bench roofline``, ``kvserve sim`` (``profile``, ``validate``) and ``kvserve plan``."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.engine.arg_utils import add_engine_args, engine_kwargs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged-KV, continuously batched LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.entrypoints import generate_cmd
    from kvserve.bench import serve as bench_serve
    from kvserve.bench import prefix as prefix_bench
    from kvserve.bench import accuracy, report, roofline, spec as spec_bench, throughput
    from kvserve.entrypoints.openai import api_server

    gen = sub.add_parser("generate", help="generate answers for chat prompts (default: the built-in set)")
    add_engine_args(gen)
    generate_cmd.add_args(gen)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    add_engine_args(srv)
    api_server.add_args(srv)
    from kvserve.entrypoints import ray_serve_args
    ray_serve_args.add_args(srv)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput: static vs continuous (vs transformers)")
    add_engine_args(tp)
    throughput.add_args(tp)
    px = bench_sub.add_parser("prefix", help="prefix caching on vs off: few-shot, multi-round, Mooncake, no sharing")
    add_engine_args(px)
    prefix_bench.add_args(px)
    sb = bench_sub.add_parser("spec", help="speculative decoding on Spec-Bench: none vs ngram vs draft_model at batch 1 and 8")
    add_engine_args(sb)
    spec_bench.add_args(sb)
    ac = bench_sub.add_parser("accuracy", help="teacher-forced top-1 agreement and perplexity of a quantization "
                                               "vs fp32 (GSM8K texts)")
    add_engine_args(ac, skip=("quantization",))
    accuracy.add_args(ac)
    rf = bench_sub.add_parser("roofline", help="machine bandwidth and int8/fp32 peaks; decode steps at batch 1-64 "
                                                "and prefill against their roofline bounds, per quantization")
    add_engine_args(rf, skip=("quantization",))
    roofline.add_args(rf)
    rp = bench_sub.add_parser("report", help="serving-behaviour report: PNG plots and report.md from fixed workloads")
    report.add_args(rp)
    bs = bench_sub.add_parser("serve", help="load-test a running kvserve server over HTTP (TTFT, TPOT, ITL, goodput)")
    bench_serve.add_args(bs)

    from kvserve.sim import cli as sim_cli
    sm = sub.add_parser("sim", help="simulate a trace on the real scheduler with a measured step-cost model")
    sim_cli.add_args(sm)
    sim_sub = sm.add_subparsers(dest="sim_command")
    sp = sim_sub.add_parser("profile", help="time real engine steps and save the cost-model profile (JSON)")
    sim_cli.add_profile_args(sp)
    from kvserve.sim import validate as sim_validate
    sv = sim_sub.add_parser("validate", help="the same Azure slice on a real server and simulated, at several rates")
    sim_validate.add_args(sv)

    from kvserve.sim import plan as sim_plan
    pl = sub.add_parser("plan", help="capacity planner: the settings with the highest simulated goodput under SLOs")
    sim_plan.add_args(pl)

    bench_sub.add_parser("quant-kernels", add_help=False,
                         help="quantized matmul kernels vs fp32 and PyTorch's quantized ops on the model's shapes "
                              "(flags: kvserve bench quant-kernels --help)")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "quant-kernels"]:  # its own parser (kvserve.bench.quant_kernels.main)
        from kvserve.bench import quant_kernels

        return quant_kernels.main(argv[2:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return generate_cmd.run(args)
        if args.command == "bench" and args.bench_command == "throughput":
            return throughput.run(args)
        if args.command == "bench" and args.bench_command == "prefix":
            return prefix_bench.run(args)
        if args.command == "bench" and args.bench_command == "spec":
            return spec_bench.run(args)
        if args.command == "bench" and args.bench_command == "accuracy":
            return accuracy.run(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "roofline":
            return roofline.run(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "report":
            return report.run(args)
        if args.command == "serve":
            if ray_serve_args.wants_ray(args):
                return ray_serve_args.run(args, engine_kwargs(args))
            return api_server.run(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "serve":
            return bench_serve.run(args)
        if args.command == "plan":
            return sim_plan.run(args)
        if args.command == "sim":
            if args.sim_command == "profile":
                return sim_cli.run_profile(args)
            return sim_validate.run(args) if args.sim_command == "validate" else sim_cli.run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
