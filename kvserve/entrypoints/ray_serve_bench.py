"""``python -m kvserve.entrypoints.ray_serve_bench``: ShareGPT multi-round conversations against a Ray Serve
deployment (``kvserve serve --data-parallel-size N``), once per router, on the same replicas.

Each router's run sends rounds 2, 3, ... of the same users wave by wave (every user's round k at once, the next
wave when it has finished: a user answers after reading the reply) through ``kvserve bench serve``'s load
generator (``run_benchmark``, streamed, ``ignore_eos``), and reports ``bench serve``'s summary (TTFT p50 / p99 ...)
plus the prefix-cache hit rate from the replicas' ``/metrics`` counters over the run. Every prompt of a run starts
with a token of its own, so the runs share no cached block; the router is swapped in place between runs
(``get_router().policy``), so they use the same warm replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from kvserve.bench.prefix import multiround_waves
from kvserve.bench.serve import (LoadRequest, fetch_prefix_counters, format_table, prefix_hit_rate, run_benchmark,
                                 summarize)
from kvserve.bench.workloads import default_data_dir
from kvserve.distributed.router import ROUTERS, make_router
from kvserve.entrypoints import ray_serve_ingress as ingress
from kvserve.entrypoints.ray_serve import get_router


def run_router(url: str, model: str, waves: list, router: str, marker: int) -> dict:
    """One router's run over ``waves`` (``TimedRequest`` lists); ``bench serve``'s summary plus the hit rate."""
    get_router().policy = make_router(router)
    before = fetch_prefix_counters(url)
    results, t0 = [], time.perf_counter()
    for wave in waves:
        reqs = [LoadRequest([marker] + r.prompt_token_ids, r.output_len) for r in wave]
        res, _ = asyncio.run(run_benchmark(url, model, reqs, [0.0] * len(reqs)))
        results += res
    summary = summarize(results, time.perf_counter() - t0, {})
    summary.update(prefix_hit_rate(before, fetch_prefix_counters(url)))
    summary["router"] = router
    return summary


def simulate(profile: str, waves: list, replicas: int, routers: list, max_model_len: int) -> list:
    """The same waves on ``replicas`` simulated engines (``kvserve.sim.cluster``) per router: each wave arrives
    all at once, 1000 s after the previous one (it has finished by then, as in the real closed-loop run)."""
    from kvserve.sim.cli import build_simulator
    from kvserve.sim.cluster import ClusterSimulator
    from kvserve.sim.trace import TraceRequest

    sim, _ = build_simulator({"max_model_len": max_model_len, "num_threads": 1}, profile)
    out = []
    for k, router in enumerate(routers):
        trace = [TraceRequest(1000.0 * w, len(r.prompt_token_ids) + 1, r.output_len,
                              token_ids=[1000 + k] + r.prompt_token_ids) for w, wave in enumerate(waves) for r in wave]
        s = ClusterSimulator(sim, replicas, make_router(router)).run(trace).summary
        s["duration_s"] = None  # idle gaps between waves: not comparable
        out.append(s)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.entrypoints.ray_serve_bench", description=__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default="prefix,round-robin")
    p.add_argument("--num-users", type=int, default=5,
                   help="conversations (an odd count: round-robin cannot keep them on one replica by accident)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per user (from round 2)")
    p.add_argument("--max-input-tokens", type=int, default=768)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--output-json", default=None)
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="also simulate the same waves on the same number of replicas with this cost-model profile")
    args = p.parse_args(argv)
    routers = args.routers.split(",")
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        raise SystemExit(f"--routers must be from {', '.join(ROUTERS)}, got {bad}")
    server = ingress.build_server({"max_model_len": args.max_model_len}, args.replicas, routers[0], port=0,
                                  log_level="warning", access_log=False)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url, model = f"http://127.0.0.1:{server.port}", server.config.app.state.served_model_name
    try:
        waves = multiround_waves(server.llm.tokenizer, default_data_dir(), args.num_users, args.max_input_tokens,
                                 args.output_len)[:args.rounds]
        print(f"{args.replicas} replicas; waves of {[len(w) for w in waves]} requests; "
              f"{sum(len(r.prompt_token_ids) for w in waves for r in w)} prompt tokens per router", flush=True)
        rows = []
        for k, router in enumerate(routers):
            s = run_router(url, model, waves, router, 1000 + k)
            rows.append(s)
            print(f"--- {router}\n{format_table(s)}", flush=True)
        sims = simulate(args.simulate, waves, args.replicas, routers, args.max_model_len) if args.simulate else []
        for real, sim in zip(rows, sims):
            print(f"{real['router']:>13}: hit rate real {100 * real['prefix_cache_hit_rate']:.1f}% / simulated "
                  f"{100 * sim['prefix_cache_hit_rate']:.1f}%; TTFT p50 real {real['median_ttft_ms']:.0f} ms / "
                  f"simulated {sim['median_ttft_ms']:.0f} ms; p99 {real['p99_ttft_ms']:.0f} / {sim['p99_ttft_ms']:.0f}")
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"real": rows, "simulated": sims}, f, indent=1)
    finally:
        server.should_exit = True
        thread.join(60)
        ingress.shutdown_ray()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
