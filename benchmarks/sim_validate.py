"""The simulator against the real server: ``python -m benchmarks.sim_validate --profile P [--rate R]``.

1. Start ``kvserve serve`` (the engine flags given here) on a free loopback port.
2. Send one slice of the Azure 2023 conversation trace (``--num-requests`` rows, token counts / ``--length-scale``)
   as a Poisson process at ``--rate`` requests/s (``kvserve bench serve``'s client), EOS ignored.
3. Send the same slice again (same lengths and send offsets, fresh prompt tokens: no prefix-cache hit from the first
   run): the real server's own run-to-run spread.
4. Replay the first run's requests, at their actual send offsets, in ``kvserve sim`` with the profile.

It prints each metric for both real runs and the simulation, the repeat's difference from the first run and the
simulation's error against it: a prediction is as good as the hardware allows when its error is within the spread.
Results: docs/simulator.md, "Validation".
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import time

import httpx

from kvserve.bench.serve import fetch_model, request_records, run_benchmark
from kvserve.bench.workloads import SAFE_TOKEN_RANGE, LoadRequest, azure_trace
from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
from kvserve.metrics import summarize
from kvserve.sim.cli import build_simulator
from kvserve.sim.trace import read_bench_records

METRICS = (("output_throughput", "output tok/s"), ("request_throughput", "req/s"),
           ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
           ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
           ("median_e2el_ms", "e2e p50 ms"), ("p99_e2el_ms", "e2e p99 ms"))


def relative(value, reference):
    """``(value - reference) / reference``, or ``None`` when either is missing or the reference is 0."""
    return (value - reference) / reference if reference and value is not None else None


def compare(real: dict, sim: dict) -> dict:
    """``{metric: (real, sim, relative error)}`` for ``METRICS`` of two ``summarize`` dicts."""
    return {key: (real.get(key), sim.get(key), relative(sim.get(key), real.get(key))) for key, _ in METRICS}


def format_comparison(rows: list) -> str:
    """Rows of ``(run name, compare(...))`` as a text table (error in %)."""
    def num(v):
        return float("nan") if v is None else v

    lines = [f"{'run':<22}{'metric':<16}{'real':>10}{'sim':>10}{'error':>9}"]
    for name, comp in rows:
        for key, label in METRICS:
            r, s, e = comp[key]
            lines.append(f"{name:<22}{label:<16}{num(r):>10.1f}{num(s):>10.1f}{100 * num(e):>8.1f}%")
    return "\n".join(lines)


def start_server(engine_args: dict, timeout: float = 600.0) -> tuple:
    """``kvserve serve`` with these engine arguments on a free loopback port; ``(process, url)`` once healthy.

    Raises:
        ValueError: the server exited or was not healthy within ``timeout`` seconds (it is stopped then).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [(f"--{'' if v else 'no-'}{k.replace('_', '-')}" if isinstance(v, bool) else f"--{k.replace('_', '-')}={v}")
             for k, v in engine_args.items() if v is not None and k != "speculative_config"]
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port),
                             "--no-access-log", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise ValueError(f"kvserve serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(1.0)
        raise ValueError(f"kvserve serve not healthy after {timeout} s")
    except BaseException:
        proc.terminate()
        proc.wait()
        raise


def run_slice(url: str, model: str, reqs: list) -> tuple:
    """Send ``reqs`` at their offsets; ``(summary, request records)``."""
    results, duration = asyncio.run(run_benchmark(url, model, reqs, [r.arrival_s for r in reqs]))
    return summarize(results, duration, {}), request_records([[r] for r in reqs], [[r] for r in results])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validate", description=__doc__.split("\n\n")[0])
    add_engine_args(p, skip=("device", "speculative_config"))
    p.add_argument("--profile", required=True, help="cost-model profile (`kvserve sim profile`)")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s, Poisson (default 1)")
    p.add_argument("--num-requests", type=int, default=60, help="trace rows in the slice (default 60)")
    p.add_argument("--length-scale", type=float, default=8.0, help="divide the trace's token counts by this (default 8)")
    p.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    p.add_argument("--seed", type=int, default=0, help="arrivals and the repeat's prompts (default 0)")
    args = p.parse_args(argv)
    engine_args = engine_kwargs(args)
    try:
        sim, _ = build_simulator(engine_args, args.profile)  # a bad profile or missing trace fails before the server
        rows = azure_trace(args.num_requests, args.seed, args.data_dir, scale=args.length_scale)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    t, first = 0.0, []
    for r in rows:
        t += rng.expovariate(args.rate)
        first.append(LoadRequest(r.prompt_token_ids, r.output_len, t))
    again = [LoadRequest([rng.randrange(*SAFE_TOKEN_RANGE) for _ in r.prompt], r.output_len, r.arrival_s)
             for r in first]
    proc, url = start_server(engine_args)
    try:
        model = fetch_model(url)
        run_slice(url, model, [LoadRequest(list(range(1000, 1064)), 8, 0.0)] * 2)  # warm-up
        real, records = run_slice(url, model, first)
        repeat, _ = run_slice(url, model, again)
    finally:
        proc.terminate()
        proc.wait()
    simulated = sim.run(read_bench_records(records)).summary
    print(f"{len(first)} requests at {args.rate} req/s; real run, its repeat, and the simulation of the first run")
    print(f"{'metric':<16}{'real':>10}{'repeat':>10}{'spread':>9}{'sim':>10}{'error':>9}  within spread")
    for key, label in METRICS:
        r, again_v, s = real.get(key), repeat.get(key), simulated.get(key)
        spread, err = relative(again_v, r), relative(s, r)
        ok = "-" if spread is None or err is None else ("yes" if abs(err) <= abs(spread) else "no")
        cells = [f"{v:>10.1f}" if v is not None else f"{'n/a':>10}" for v in (r, again_v)]
        pct = [f"{100 * v:>8.1f}%" if v is not None else f"{'n/a':>9}" for v in (spread, err)]
        sim_cell = f"{s:>10.1f}" if s is not None else f"{'n/a':>10}"
        print(f"{label:<16}{cells[0]}{cells[1]}{pct[0]}{sim_cell}{pct[1]}  {ok}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
