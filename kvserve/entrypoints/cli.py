"""``kvserve`` command line: ``kvserve generate`` (the main job), ``kvserve serve`` (the HTTP server), and
``kvserve bench throughput`` / ``kvserve bench serve``."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine arguments shared by every subcommand (names as in vLLM)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="force the KV pool to this many blocks")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool budget in bytes")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget (default 512 with chunked prefill, else 8192)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps under the token budget (default on)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share computed KV blocks between requests with a common prefix (default on)")
    g.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("model", "dtype", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory_bytes",
            "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "scheduling",
            "scheduling_policy", "num_threads", "speculative_config")
    return {k: getattr(args, k) for k in keys}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged-KV, continuously batched LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.entrypoints import generate_cmd
    from kvserve.bench import serve as bench_serve
    from kvserve.bench import prefix as prefix_bench
    from kvserve.bench import report, spec as spec_bench, throughput
    from kvserve.entrypoints.openai import api_server

    gen = sub.add_parser("generate", help="generate answers for chat prompts (default: the built-in set)")
    add_engine_args(gen)
    generate_cmd.add_args(gen)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    add_engine_args(srv)
    api_server.add_args(srv)

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
    rp = bench_sub.add_parser("report", help="serving-behaviour report: PNG plots and report.md from fixed workloads")
    report.add_args(rp)
    bs = bench_sub.add_parser("serve", help="load-test a running kvserve server over HTTP (TTFT, TPOT, ITL, goodput)")
    bench_serve.add_args(bs)

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
        if args.command == "bench" and args.bench_command == "report":
            return report.run(args)
        if args.command == "serve":
            return api_server.run(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "serve":
            return bench_serve.run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
