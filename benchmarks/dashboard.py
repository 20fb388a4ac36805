"""Throughput with the dashboard open vs closed, in one run: ``python -m benchmarks.dashboard``.

One ``kvserve serve`` (loopback, so the dashboard is on) is loaded once; then ``kvserve bench serve`` runs the same
workload ``--rounds`` times with the page closed and with the page open (headless Chromium on ``/dashboard``,
redrawing at up to 10 Hz from the state stream), alternating the order each round (closed-open, open-closed, ...)
so that slow drift of a shared machine falls on both sides. Prints each run and the mean output token throughput of
each side and the open/closed ratio of each round (its two runs are adjacent in time); ``--output-json`` saves
them. Needs Debian's ``chromium`` (``--chromium``) and the ``playwright``
package (a dev dependency); it never downloads a browser.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _bench(base_url: str, args: argparse.Namespace, out: str, num_prompts: int) -> dict:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url", base_url,
           "--dataset", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(num_prompts), "--request-rate", str(args.request_rate),
           "--seed", "1", "--ignore-eos", "--quiet", "--output-json", out]
    subprocess.run(cmd, check=True)
    with open(out) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--rounds", type=int, default=3, help="closed + open pairs")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(args.port),
                         "--no-access-log", "--uvicorn-log-level", "warning", "--max-num-seqs", str(args.max_num_seqs)])
    runs = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
            # warm-up: the whole workload once (the first batch of this size is slower: allocations, caches)
            _bench(base, args, os.path.join(tmp, "warmup.json"), args.num_prompts)
            for rnd in range(args.rounds):
                for mode in (("closed", "open") if rnd % 2 == 0 else ("open", "closed")):
                    ctx = page = None
                    if mode == "open":
                        ctx = pw.chromium.launch_persistent_context(
                            os.path.join(tmp, f"profile{rnd}"), executable_path=args.chromium, headless=True,
                            args=FLAGS, viewport={"width": 1440, "height": 980})
                        page = ctx.new_page()
                        page.goto(base + "/dashboard")
                        page.wait_for_function("() => window.kvDashboard && window.kvDashboard.renders > 0")
                        page.evaluate("() => { const d = window.kvDashboard; d.renders = 0; d.buildMsSum = 0; "
                                      "d.buildMsCount = 0; }")
                        t0 = time.monotonic()
                    report = _bench(base, args, os.path.join(tmp, f"{mode}{rnd}.json"), args.num_prompts)
                    run = {"round": rnd, "mode": mode, "output_throughput": report["output_throughput"],
                           "duration": report["duration_s"], "completed": report["completed"],
                           "mean_tpot_ms": report.get("mean_tpot_ms"), "mean_ttft_ms": report.get("mean_ttft_ms")}
                    if page is not None:
                        d = page.evaluate("() => { const d = window.kvDashboard; return {renders: d.renders, "
                                          "buildMsSum: d.buildMsSum, buildMsCount: d.buildMsCount}; }")
                        run["page_updates_per_s"] = d["renders"] / (time.monotonic() - t0)
                        run["mean_build_ms"] = d["buildMsSum"] / max(1, d["buildMsCount"])
                        ctx.close()
                    runs.append(run)
                    print(f"round {rnd} {mode:6s} {run['output_throughput']:7.2f} output tok/s  "
                          f"{run['duration']:6.2f} s  {run['completed']} done"
                          + (f"  page {run['page_updates_per_s']:.1f} updates/s, snapshot build "
                             f"{run['mean_build_ms']:.2f} ms" if page is not None else ""),
                          flush=True)
    finally:
        server.terminate()
        server.wait(60)
    closed = [r["output_throughput"] for r in runs if r["mode"] == "closed"]
    opened = [r["output_throughput"] for r in runs if r["mode"] == "open"]
    ratios = [o / c - 1 for o, c in zip(opened, closed)]  # the two runs of a round are adjacent in time
    summary = {"closed_mean": statistics.mean(closed), "open_mean": statistics.mean(opened),
               "closed_median": statistics.median(closed), "open_median": statistics.median(opened),
               "open_vs_closed_per_round": ratios, "open_vs_closed_median": statistics.median(ratios),
               "open_vs_closed_of_means": statistics.mean(opened) / statistics.mean(closed) - 1}
    print(f"closed mean {summary['closed_mean']:.2f} / median {summary['closed_median']:.2f} tok/s, "
          f"open mean {summary['open_mean']:.2f} / median {summary['open_median']:.2f} tok/s; open vs closed: "
          f"{100 * summary['open_vs_closed_of_means']:+.1f}% (means), per round "
          + ", ".join(f"{100 * r:+.1f}%" for r in ratios)
          + f" (median {100 * summary['open_vs_closed_median']:+.1f}%)")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"args": vars(args), "runs": runs, "summary": summary}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
