"""``python -m benchmarks.ray_serve``: ShareGPT multi-round conversations against a Ray Serve
deployment (``kvserve serve --data-parallel-size N``), once per router, on the same replicas; with ``--simulate``
the same requests replayed on the simulated cluster, real vs simulated.

Each router's run is ``kvserve bench serve --dataset sharegpt-multiround``'s closed loop (``kvserve.bench.
multiround``, ``run_sessions``: users arrive at ``--request-rate`` users/s, each sends its next round
``--think-time`` s after the previous answer ended; streamed, ``ignore_eos``) and reports ``bench serve``'s summary
plus the prefix-cache hit rate from the replicas' ``/metrics`` counters over the run and the requests each replica
served (the router's own record of where each request went). Every prompt of a run starts with a token of its own,
so the runs share no cached block; the router is swapped in place between runs (``get_router().policy``), so they
use the same warm replicas.

``--simulate PROFILE`` replays each run's requests — their actual send offsets, prompt token ids and output lengths
— on ``--replicas`` simulated engines (``kvserve.sim.cluster``) twice: behind a fresh router of the same class, and
with every request on the replica the real run put it on (``RecordedPlacement``: routing taken out of the
comparison); it prints ``benchmarks.sim_validate``'s table (real, simulated, relative error) for both, plus hit rates
and requests per replica.
"""

from __future__ import annotations

if __name__ == "__main__":  # name the extra, not a traceback, when Ray is missing
    from kvserve.extras import MissingExtraError, require

    try:
        require("ray.serve", "ray", "python -m benchmarks.ray_serve")
    except MissingExtraError as e:
        raise SystemExit(f"error: {e}") from None

import argparse
import asyncio
import json
import logging
import math
import threading
import time
from collections import Counter

from kvserve.bench.multiround import build_sessions, server_tokenizer
from benchmarks.sim_validate import compare, format_comparison
from kvserve.bench.serve import (arrival_times, fetch_prefix_counters, prefix_hit_rate, request_records,
                                 run_sessions)
from kvserve.bench.workloads import LoadRequest
from kvserve.metrics import format_table, summarize
from kvserve.distributed.router import ROUTERS, Router, least_loaded, make_router
from kvserve.entrypoints.ray import ingress
from kvserve.entrypoints.ray.router import get_router


def salted(sessions: list, marker: int) -> list:
    """``sessions`` with ``marker`` put before every prompt: another run's prompts share no block with these."""
    return [[LoadRequest([marker] + r.prompt, r.output_len) for r in s] for s in sessions]


def replica_counts(records: list, decisions) -> list:
    """Requests per replica (descending) of ``records`` (``request_records``), from the router's ``decisions``
    (``(engine request id, replica id, first hash)``; a completion's engine request id is ``<response id>-0``); each
    record gets its ``replica`` (``None`` when unknown)."""
    where = {rid: uid for rid, uid, _ in decisions}
    for r in records:
        r["replica"] = where.get(f"{r['response_id']}-0") if r.get("response_id") else None
    return sorted(Counter(r["replica"] for r in records if r["replica"] is not None).values(), reverse=True)


def run_router(url: str, model: str, sessions: list, offsets: list, think_time: float, router: str) -> tuple:
    """One router's real run of ``sessions`` (already salted); returns ``(summary, request records)``."""
    get_router().policy = make_router(router)
    before = fetch_prefix_counters(url)
    results, duration = asyncio.run(run_sessions(url, model, sessions, offsets, think_time=think_time))
    summary = summarize([r for res in results for r in res], duration, {})
    summary.update(prefix_hit_rate(before, fetch_prefix_counters(url)))
    records = request_records(sessions, results, multiround=True)
    summary.update(router=router, requests_per_replica=replica_counts(records, get_router().decisions))
    return summary, records


class RecordedPlacement(Router):
    """Sends the k-th request of a replayed trace to the replica the real run sent it to (``placements[k]``, an
    index into the sorted replica ids), or to the least loaded replica when that is unknown (``None``): the
    simulated cluster then differs from the real run only in its cost model, not in routing."""

    name = "recorded"

    def __init__(self, placements: list):
        self._placements = iter(placements)

    def choose(self, block_hashes, loads: dict):
        pick = next(self._placements, None)
        return pick if pick in loads else least_loaded(loads)


def simulate(sim, records: list, replicas: int, router: str, contention=(None, None)) -> dict:
    """The recorded requests (actual send offsets, token ids, output lengths) on ``replicas`` simulated engines
    (``kvserve.sim.cluster``), behind a fresh ``router`` and behind ``RecordedPlacement`` (each request on the
    replica the real run chose: the router in the ingress sees concurrent requests in its own order, and Serve may
    send a request to another replica than the one chosen). Returns ``{router: summary, "recorded placement":
    summary}`` (``requests_per_replica`` descending). ``contention``: ``(decode factors, prompt factors)`` with 1 ..
    N replicas of a host busy (``kvserve.sim.cluster``); ``(None, None)``: independent machines."""
    from kvserve.sim.cluster import ClusterSimulator
    from kvserve.sim.trace import read_bench_records

    sent = sorted((r for r in records if r.get("start_s") is not None), key=lambda r: r["start_s"])
    trace = read_bench_records(sent)  # the same order: already sorted
    ids = sorted({r["replica"] for r in sent if r.get("replica") is not None})
    placements = [ids.index(r["replica"]) if r.get("replica") in ids else None for r in sent]
    out = {}
    fresh = make_router(router)
    if router == "prefix":
        fresh.cache_blocks = sim.num_blocks  # as the Ray router sizes it: each replica's pool
    for name, policy in ((router, fresh), ("recorded placement", RecordedPlacement(placements))):
        s = ClusterSimulator(sim, replicas, policy, *contention).run(trace).summary
        s["requests_per_replica"] = sorted(s["requests_per_replica"], reverse=True)
        out[name] = s
    return out


def format_validation(real: dict, sims: dict) -> str:
    """``benchmarks.sim_validate``'s table (real, simulated, error) for each simulated run in ``sims`` (name ->
    summary), then hit rates and requests per replica."""
    lines = [format_comparison([(name, compare(real, s)) for name, s in sims.items()])]
    hr = 100 * (real.get("prefix_cache_hit_rate") or 0.0)
    for name, s in sims.items():
        h = 100 * s["prefix_cache_hit_rate"]
        lines.append(f"{name:<22}{'hit rate %':<16}{hr:>10.1f}{h:>10.1f}{h - hr:>+8.1f} pt")
    lines.append(f"requests per replica: real {real['requests_per_replica']}, " +
                 ", ".join(f"{name} {s['requests_per_replica']}" for name, s in sims.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default="prefix,round-robin")
    p.add_argument("--num-users", type=int, default=5,
                   help="conversations (an odd count: round-robin cannot keep them on one replica by accident)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per user (at most)")
    p.add_argument("--max-input-tokens", type=int, default=768, help="a user's rounds stop before a longer prompt")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=math.inf, help="users/s (Poisson); inf = all at once")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between an answer and the next round")
    p.add_argument("--seed", type=int, default=0, help="user arrivals")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--output-json", default=None, help="summaries and every request (send offset, token ids ...)")
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="also replay each run's requests on as many simulated replicas with this cost-model profile")
    p.add_argument("--contention", default=None,
                   help="with --simulate: step-time factors while 1, 2, ... replicas compute at once (kvserve sim "
                        "--contention; default: independent machines)")
    args = p.parse_args(argv)
    routers = args.routers.split(",")
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        raise SystemExit(f"--routers must be from {', '.join(ROUTERS)}, got {bad}")
    if not args.think_time >= 0:
        raise SystemExit(f"--think-time must be >= 0, got {args.think_time}")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sim, contention = None, (None, None)
    if args.simulate:  # a bad profile fails before Ray starts
        from kvserve.sim.cli import build_simulator
        from kvserve.sim.cluster import contention_arg

        sim, _ = build_simulator({"max_model_len": args.max_model_len, "num_threads": 1}, args.simulate)
        try:
            contention = contention_arg(args.contention)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    server = ingress.build_server({"max_model_len": args.max_model_len}, args.replicas, routers[0], port=0,
                                  log_level="warning", access_log=False)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url, model = f"http://127.0.0.1:{server.port}", server.config.app.state.served_model_name
    try:
        try:  # before the calibration: a workload the dataset cannot give fails at once
            sessions = build_sessions(server_tokenizer(url, model), args.num_users, max_rounds=args.rounds,
                                      max_input_len=args.max_input_tokens - 1, output_len=args.output_len,
                                      flags={"users": "--num-users", "rounds": "--rounds",
                                             "input": "--max-input-tokens", "output": "--output-len"},
                                      shown_cap=args.max_input_tokens)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        offsets = arrival_times([s[0] for s in sessions], args.request_rate, args.seed)
        print(f"{args.replicas} replicas; {len(sessions)} users, rounds {[len(s) for s in sessions]}; "
              f"{sum(len(r.prompt) + 1 for s in sessions for r in s)} prompt tokens per router", flush=True)
        rows, sims, records = [], [], {}
        for k, router in enumerate(routers):
            s, records[router] = run_router(url, model, salted(sessions, 1000 + k), offsets, args.think_time, router)
            rows.append(s)
            print(f"--- {router}\n{format_table(s)}\nrequests per replica: {s['requests_per_replica']}", flush=True)
        if sim is not None:
            for real, router in zip(rows, routers):
                sims.append(simulate(sim, records[router], args.replicas, router, contention))
            print("\nreal vs simulated (the same requests at their actual send offsets):")
            for real, s in zip(rows, sims):
                print(f"--- {real['router']}\n{format_validation(real, s)}", flush=True)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"config": vars(args), "real": rows, "simulated": sims, "requests": records}, f)
    finally:
        server.should_exit = True
        thread.join(60)
        ingress.shutdown_ray()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
