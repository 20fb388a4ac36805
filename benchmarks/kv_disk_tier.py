"""The prefix cache's disk tier (``--kv-disk-cache-dir``): ``python -m benchmarks.kv_disk_tier {restart,serve}``.

``restart``: one shared prefix of ``--prefix-len`` tokens (4,000 by default) + a short random suffix. Alternating,
``--repeats`` times: the cold prefill's TTFT on a fresh engine without the tier, and the TTFT of a *new* engine on
a directory an earlier engine filled (a restart): its prefix comes from disk, its suffix is computed. Prints both
medians and their ratio (the target: at most 10%), the bytes read and the load time. Engines are built outside the
timed part; the first engine with the tier (which writes the entries) is timed too, to show the cost of writing.

``serve``: ``--num-prefixes`` distinct system prompts of ``--prefix-len`` tokens (100 x 2,000 by default), each
followed by a random suffix, ``--num-prompts`` requests in a shuffled order (``kvserve bench serve --dataset-name
prefix_repetition``) at a fixed ``--request-rate``, against a server whose pool holds only ``--pool-fraction`` of
the prefixes' KV, with the tier off and then on (a fresh directory). Prints the server's prefix-cache hit rate
(prompt tokens found in the pool at admission; with the tier, blocks loaded from disk count as found), the
tier's block hit counts, and the mean / p99 TTFT of each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from kvserve.bench.workloads import SAFE_TOKEN_RANGE


def _ttft(llm, prompt: list) -> float:
    """Seconds from ``add_request`` to the step that gives the first token (greedy, 1 token)."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    t0 = time.perf_counter()
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def restart(args) -> dict:
    from kvserve import LLM

    rng = random.Random(args.seed)
    prefix = [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(args.prefix_len)]

    def prompt() -> list:
        return prefix + [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(args.suffix_len)]

    engine_args = dict(num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens)
    cold, warm, loads, written = [], [], [], None
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        first = LLM(kv_disk_cache_dir=d, **engine_args)
        first_ttft = _ttft(first, prompt())
        first.llm_engine.shutdown()  # (waits for its writes)
        written = first.llm_engine.kv_tier.stats.bytes_written
        del first
        for i in range(args.repeats):
            for mode in (("cold", "restart") if i % 2 == 0 else ("restart", "cold")):
                llm = LLM(kv_disk_cache_dir=d, **engine_args) if mode == "restart" else LLM(**engine_args)
                t = _ttft(llm, prompt())
                if mode == "restart":
                    s = llm.llm_engine.kv_tier.stats
                    loads.append({"ttft_s": t, "blocks": s.hits, "bytes_read": s.bytes_read,
                                  "load_s": s.load_seconds})
                    warm.append(t)
                    llm.llm_engine.shutdown()
                else:
                    cold.append(t)
                print(f"{mode:8s} TTFT {t * 1000:9.1f} ms", flush=True)
                del llm
    out = {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "cold_ttft_s": cold,
           "restart_ttft_s": warm, "first_with_tier_ttft_s": first_ttft, "bytes_written": written, "loads": loads,
           "cold_median_s": statistics.median(cold), "restart_median_s": statistics.median(warm)}
    out["restart_over_cold"] = out["restart_median_s"] / out["cold_median_s"]
    print(f"cold prefill TTFT median {out['cold_median_s'] * 1000:.1f} ms; after a restart with the tier "
          f"{out['restart_median_s'] * 1000:.1f} ms ({100 * out['restart_over_cold']:.1f}% of cold; "
          f"{loads[-1]['blocks']} blocks, {loads[-1]['bytes_read'] / 2**20:.0f} MiB read, load "
          f"{loads[-1]['load_s'] * 1000:.0f} ms); first engine with the tier (writing "
          f"{written / 2**20:.0f} MiB) {first_ttft * 1000:.1f} ms")
    return out


_TIER_COUNTER = re.compile(r"^kvserve:kv_disk_cache_(queries|hits|read_bytes)_total(?:\{[^}]*\})?\s+(\S+)\s*$")


def _start_server(args, extra: list) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(args.port), "--no-access-log",
           "--uvicorn-log-level", "warning", "--num-kv-blocks", str(args.num_kv_blocks_serve),
           "--max-num-seqs", str(args.max_num_seqs)] + extra
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


def serve(args) -> dict:
    blocks_per_prefix = args.prefix_len // 16
    args.num_kv_blocks_serve = args.num_kv_blocks or max(
        int(args.pool_fraction * args.num_prefixes * blocks_per_prefix),
        2 * ((args.prefix_len + args.suffix_len + args.output_len) // 16 + 1))  # (two requests at least)
    print(f"pool: {args.num_kv_blocks_serve} blocks of 16 tokens; the prefixes' KV: "
          f"{args.num_prefixes * blocks_per_prefix} blocks", flush=True)
    runs = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for mode in ("off", "on"):
            server = _start_server(args, ["--kv-disk-cache-dir", d] if mode == "on" else [])
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "report.json")
                    subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url",
                                    f"http://127.0.0.1:{args.port}", "--dataset-name", "prefix_repetition",
                                    "--prefix-repetition-prefix-len", str(args.prefix_len),
                                    "--prefix-repetition-suffix-len", str(args.suffix_len),
                                    "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                                    "--prefix-repetition-output-len", str(args.output_len),
                                    "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                                    "--seed", str(args.seed), "--ignore-eos", "--quiet", "--output-json", out],
                                   check=True)
                    with open(out) as fh:
                        report = json.load(fh)
                metrics = httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text
                tier = {}
                for line in metrics.splitlines():
                    m = _TIER_COUNTER.match(line)
                    if m:
                        tier[m.group(1)] = float(m.group(2))
            finally:
                server.terminate()
                server.wait(60)
            runs[mode] = {"prefix_cache_hit_rate": report.get("prefix_cache_hit_rate"),
                          "mean_ttft_ms": report["mean_ttft_ms"], "p99_ttft_ms": report["p99_ttft_ms"],
                          "completed": report["completed"], "duration_s": report["duration_s"], "tier": tier}
            r = runs[mode]
            print(f"tier {mode:3s}: prefix-cache hit rate {100 * (r['prefix_cache_hit_rate'] or 0):5.1f}%, TTFT mean "
                  f"{r['mean_ttft_ms']:8.1f} ms p99 {r['p99_ttft_ms']:8.1f} ms, {r['completed']} done in "
                  f"{r['duration_s']:.0f} s" + (f"; tier blocks looked up {tier.get('queries', 0):.0f}, loaded "
                                                f"{tier.get('hits', 0):.0f}" if mode == "on" else ""), flush=True)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_disk_tier", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("restart", help="TTFT of a long shared prefix after a restart vs the cold prefill")
    r.add_argument("--prefix-len", type=int, default=4000)
    r.add_argument("--suffix-len", type=int, default=16)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--num-kv-blocks", type=int, default=512)
    r.add_argument("--max-num-batched-tokens", type=int, default=512)
    s = sub.add_parser("serve", help="many distinct system prompts whose KV exceeds the pool, tier off vs on")
    s.add_argument("--num-prefixes", type=int, default=100)
    s.add_argument("--prefix-len", type=int, default=2000)
    s.add_argument("--suffix-len", type=int, default=32)
    s.add_argument("--output-len", type=int, default=16)
    s.add_argument("--num-prompts", type=int, default=300)
    s.add_argument("--request-rate", type=float, default=0.5)
    s.add_argument("--pool-fraction", type=float, default=0.25, help="the pool holds this share of the prefixes")
    s.add_argument("--num-kv-blocks", type=int, default=None, help="(overrides --pool-fraction)")
    s.add_argument("--max-num-seqs", type=int, default=8)
    s.add_argument("--port", type=int, default=8131)
    for q in (r, s):
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--dir", default=None, help="where the tier's temporary directory goes (default: $TMPDIR)")
        q.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    out = restart(args) if args.part == "restart" else serve(args)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"args": vars(args), "result": out}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
