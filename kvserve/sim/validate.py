"""``kvserve sim validate``: the same trace slice really (``kvserve serve`` + ``bench serve``'s client) and
simulated, at several load levels; prints both and the relative error of each metric.

The slice is the Azure 2023 trace as ``kvserve bench serve --dataset azure`` builds it (token counts divided by
``--length-scale``, capped; random prompt tokens), with its arrival offsets rescaled so that its mean rate is the
level's rate. Each level uses fresh prompts (its own seed), so no level reads another's prefix cache — the
measurement trap of ``docs/server_benchmarks.md``. The simulator gets exactly the requests the client sends (the
same token ids and send offsets) and the server's engine flags.

The server is started here as a subprocess (``python -m kvserve.entrypoints.cli serve``) on a free loopback port, or
reached at ``--base-url`` when given, and warmed up with a few requests before the first level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvserve.bench.serve import (LoadRequest, fetch_model, fetch_prefix_counters, parse_goodput, prefix_hit_rate,
                                 request_records, run_benchmark, run_sessions, summarize)
from kvserve.bench.server_process import popen_tied, sigterm_as_exit
from kvserve.bench.workloads import SAFE_TOKEN_RANGE, azure_trace
from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
from kvserve.sim.cluster import parse_list
from kvserve.sim.profile import check_warmup_s
from kvserve.sim.trace import TraceRequest, read_step_trace

METRICS = (("output_throughput", "output tok/s"), ("request_throughput", "req/s"),
           ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
           ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
           ("median_e2el_ms", "e2e p50 ms"), ("p99_e2el_ms", "e2e p99 ms"))


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, skip=("device", "speculative_config"))
    p.add_argument("--profile", default="profile.json",
                   help="the cost-model profile (`kvserve sim profile --output FILE`; default: profile.json)")
    p.add_argument("--rates", default="0.1,0.3,0.6",
                   help="comma-separated request rates (req/s), one per level (default: 0.1,0.3,0.6)")
    p.add_argument("--num-prompts", type=int, default=24, help="requests per level")
    p.add_argument("--length-scale", type=float, default=8.0,
                   help="the Azure trace's token counts are divided by this (default: 8, for a small model on a CPU)")
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--azure-kind", choices=["conv", "code"], default="conv")
    p.add_argument("--data-dir", default=None,
                   help="the folder holding azure_llm_2023/ (default: ../shared/data next to the repository)")
    p.add_argument("--seed", type=int, default=100, help="level i uses seed + i (fresh prompts per level)")
    p.add_argument("--base-url", default=None, help="use this running server instead of starting one")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS")
    p.add_argument("--max-duration", type=float, default=900.0, help="seconds per level")
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-calibration", action="store_true",
                   help="measure the server calibration first and store it in the profile (else the profile's own, "
                        "if any, is used)")
    p.add_argument("--calibrate-each-level", action="store_true",
                   help="with --save-calibration: measure the calibration again before every level (on a shared "
                        "machine whose load drifts, each level is then simulated at its own moment's speed)")
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="the server's step trace (`kvserve serve --step-trace`; default: a temporary file when the "
                        "server is started here, removed at the end): each level also compares the server's steps with the "
                        "cost model, step by step")
    p.add_argument("--fit-each-level", action="store_true",
                   help="also replay each level with the calibration fitted afterwards on that level's own server "
                        "steps (needs the step trace): not a prediction, but it tells the simulator's error apart "
                        "from the machine's speed drifting between calibration and level")
    p.add_argument("--bracket", action="store_true",
                   help="with --save-calibration --calibrate-each-level: calibrate once more after the last level and "
                        "also replay each level with the mean of the calibrations just before and just after it (the "
                        "host's speed measured around the level, none of the level's own steps): tells the host's "
                        "drift apart from the simulator's error while staying a prediction of the level")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="seconds of throwaway requests before the first calibration or level (default 10)")
    p.add_argument("--calibration-runs", type=int, default=3,
                   help="lone prefills per calibration; each decode batch is measured runs // 3 times (more runs: "
                        "a steadier calibration, ~10 s more per 3 runs)")
    p.add_argument("--calibration-loaded-rounds", type=int, default=3, metavar="N",
                   help="with the server's step trace: end each calibration with max_num_seqs closed-loop streams of "
                        "N fresh requests each, so that the fit also sees full batches beside prompt chunks, the "
                        "steps of a loaded level (default 3, ~15-20 s per calibration; 0: none)")
    p.add_argument("--match-mix", action="store_true",
                   help="with the server's step trace: also replay each level with the calibration refitted on its "
                        "steps reweighted to the mix of steps the simulator predicts for the level (by kind and "
                        "rows); still a prediction, from the calibration's steps alone")
    p.add_argument("--real-repeats", type=int, default=1, metavar="K",
                   help="run each level's slice K times on the real server, back to back, with fresh prompt tokens "
                        "of the same lengths at the same offsets: each repeat is compared with the first run (the "
                        "host's own run-to-run spread, the floor under any prediction) and with its simulated replay "
                        "(default 1: no repeat)")


def level_requests(args, rate: float, seed: int) -> list:
    """The Azure slice for one level: ``LoadRequest`` list with arrival offsets at a mean of ``rate`` req/s."""
    reqs = azure_trace(args.num_prompts, seed, args.data_dir, kind=args.azure_kind, scale=args.length_scale,
                       max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    natural = (len(reqs) - 1) / span if span > 0 else math.inf
    k = natural / rate if math.isfinite(natural) else 0.0
    return [LoadRequest(r.prompt_token_ids, r.output_len, r.arrival_s * k) for r in reqs]


def fresh_prompts(reqs: list, seed: int) -> list:
    """``reqs`` again with new random prompt token ids of the same lengths (same ``output_len`` and arrival offsets),
    drawn from ``seed``: the same slice run once more without reading its first run's prefix cache."""
    rng = random.Random(seed)
    return [LoadRequest([rng.randrange(*SAFE_TOKEN_RANGE) for _ in r.prompt], r.output_len, r.arrival_s)
            for r in reqs]


def run_level(base_url: str, model: str, reqs: list, slos: dict, max_duration: float) -> tuple:
    """Send one level's requests (``LoadRequest`` list, at their ``arrival_s`` offsets) to the server.

    Returns:
        ``(real, records, trace, t_start, t_end)``: ``summarize``'s metrics plus the server's prefix hit rate over
        the run, ``request_records``, the requests as actually sent (``trace_from_records``), and the run's window
        on ``time.monotonic()`` (seconds), to pick the level's steps out of the server's step trace.
    """
    before = fetch_prefix_counters(base_url)
    t_start = time.monotonic()
    results, duration = asyncio.run(run_benchmark(base_url, model, reqs, [r.arrival_s for r in reqs],
                                                  max_duration=max_duration))
    t_end = time.monotonic()
    real = summarize(results, duration, slos)
    real.update(prefix_hit_rate(before, fetch_prefix_counters(base_url)))
    records = request_records([[r] for r in reqs], [[r] for r in results])
    return real, records, trace_from_records(records), t_start, t_end


def repeat_level(base_url: str, model: str, reqs: list, sim, slos: dict, real: dict, args, seed: int,
                 name: str) -> list:
    """``--real-repeats``: run the level ``args.real_repeats - 1`` more times (``fresh_prompts``, seeds ``seed``,
    ``seed + 1``, ...) and compare each run with the first (``real``; error ``(repeat - first) / first``) and with
    the simulator's replay of the requests it actually sent. Returns one dict per repeat: ``real``, ``sim``,
    ``errors_vs_first``, ``errors``."""
    out = []
    for j in range(1, args.real_repeats):
        again, _, trace, _, _ = run_level(base_url, model, fresh_prompts(reqs, seed + j - 1), slos, args.max_duration)
        simulated = sim.run(trace, slos).summary
        vs_first, vs_sim = compare(real, again), compare(again, simulated)
        out.append({"real": again, "sim": simulated, "errors_vs_first": {k: v[2] for k, v in vs_first.items()},
                    "errors": {k: v[2] for k, v in vs_sim.items()}})
        print(f"{name}, run {j + 1} of the same slice (fresh prompt tokens), against the first run as 'sim':",
              flush=True)
        print(format_comparison([(f"{name} run {j + 1}", vs_first)]), flush=True)
        print(format_comparison([(f"{name} run {j + 1} sim", vs_sim)]), flush=True)
    return out


def trace_from_records(records: list) -> list:
    """The requests a benchmark actually sent (``kvserve.bench.serve.request_records``, or the ``requests`` of a
    ``bench serve --output-json`` report) as a simulator trace: each at its actual send offset (``start_s``), with
    its prompt token ids and ``output_len`` tokens (forced, as ``ignore_eos`` does), in send order; requests never
    sent (``start_s`` null) are left out.

    Raises:
        ValueError: a record without ``prompt_token_ids`` (a text prompt: the client never saw its tokens) or
            without ``output_len``.
    """
    sent = [r for r in records if r.get("start_s") is not None]
    for i, r in enumerate(sent):
        if not isinstance(r.get("prompt_token_ids"), list) or not isinstance(r.get("output_len"), int):
            raise ValueError(f"request record {i} has no prompt_token_ids / output_len (text prompts cannot be "
                             f"replayed; use a dataset that sends token ids)")
    sent.sort(key=lambda r: r["start_s"])
    return [TraceRequest(float(r["start_s"]), len(r["prompt_token_ids"]), r["output_len"],
                         token_ids=list(r["prompt_token_ids"])) for r in sent]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags(engine_args: dict) -> list:
    flags = []
    for k, v in engine_args.items():
        if v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            flags += [flag, str(v)]
    return flags


def start_server(engine_args: dict, timeout: float = 600.0, step_trace: str | None = None) -> tuple:
    """Start ``kvserve serve`` on a free loopback port (with ``--step-trace step_trace`` when given); returns
    ``(process, base_url)`` once ``/health`` is 200.

    Raises:
        ValueError: the server exits or is not healthy within ``timeout`` seconds.
    """
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port), "--no-access-log",
           *_engine_flags(engine_args), *(["--step-trace", step_trace] if step_trace else [])]
    proc = popen_tied(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # ends with this command
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise ValueError(f"kvserve serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ValueError(f"kvserve serve not healthy after {timeout} s")
    except BaseException:  # not healthy, or interrupted while it loads (SIGTERM, Ctrl-C): stop it before leaving
        stop_server(proc)
        raise


def stop_server(proc, timeout: float = 60.0) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout`` seconds for it to end, then SIGKILL it (and reap it either way)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def calibrate(base_url: str, model: str, cost, context: int = 64, output_len: int = 24,
              prefill_len: int = 192, prefill_runs: int = 3, seed: int = 0, replicas: int = 1,
              decode_runs: int = 1, step_trace_path: str | None = None, loaded_streams: int = 0,
              loaded_rounds: int = 3) -> dict:
    """Measure a live server's decode and prefill steps against the cost model's predictions.

    Decode: the median inter-token gap of 1 and of 8 concurrent streams (fresh ``context``-token prompts,
    ``output_len`` tokens, the first 3 gaps of each stream dropped; each batch measured ``decode_runs`` times, one
    after the other, and the gaps pooled); ``server = offset_s + scale * predicted`` is
    fitted through the two points. Prefill: the median time to first token of ``prefill_runs`` lone fresh prompts of
    ``prefill_len`` tokens (one step that prefills the prompt and samples; the request's HTTP round trip is in it
    too, as it is in every real TTFT); ``prefill_scale`` is what the prefill terms must be multiplied by so that the
    calibrated step equals it.

    Returns ``{"offset_s", "scale", "prefill_scale", "points": [(batch, measured_s, predicted_s)],
    "prefill_points": [(prompt_len, measured_s, predicted_s)]}``; ``prefill_scale`` is ``None`` when the
    measurement leaves nothing positive for the prefill terms. Every prompt is drawn fresh from ``seed`` (random
    token ids): a second calibration on the same server must not find the first one's prompts in its prefix cache.
    ``replicas``: the server spreads concurrent fresh prompts over this many engines (a data-parallel
    deployment), so ``b`` streams are predicted as a step of ``ceil(b / replicas)`` rows. With ``replicas > 1`` it
    also measures ``k`` streams at once for ``k = 2 .. replicas`` (one per replica), and returns ``"contention"``:
    ``[1.0, gap_2 / gap_1, ...]`` (each at least 1), the factor by which a step slows while ``k`` replicas of the
    deployment compute at once (they share the host's cores, its memory bandwidth and Serve's proxy); the 8-stream
    point is divided by its factor first, so that ``offset_s`` and ``scale`` describe one replica computing alone
    (``kvserve.sim.cluster`` applies the factors step by step). The factors are assumed not to depend on a step's
    rows. They are not applied to prompt chunks (``ServerCalibrated.prefill_contention``): measured that way, a
    prompt beside decoding replicas took 1.56-1.61x as long, yet replays with that factor missed TTFT by more than
    replays without (docs/scale_out.md).

    With ``step_trace_path`` (the server's ``--step-trace``), a burst of 12 fresh ``prefill_len``-token prompts
    follows, 4 at once and 8 more 0.1 s apart (several prompt chunks in one step, then chunks beside decode rows:
    the steps of a loaded server), and the three numbers
    are fitted instead on every step the server ran during the calibration (``fit_from_steps``): its own loop
    turns, each against the prediction for its very plan, rather than two medians seen through HTTP. The result
    then also has ``"fit": "server steps"``, ``"steps"`` and ``"window"`` (its start and end, monotonic seconds: the
    step trace's clock); ``points`` keep the client-side view.

    ``loaded_streams`` (with ``step_trace_path``; the server's ``max_num_seqs``): last, a loaded phase, the steps of
    an overloaded level. That many closed-loop streams each send ``loaded_rounds`` fresh prompts of
    ``prefill_len // 4`` to ``prefill_len`` tokens one after the other, the streams' starts staggered over one
    request's expected time, so that about ``loaded_streams`` rows decode beside prompt chunks step after step.
    Without it the fit sees mostly 1- and 8-row decodes: on a 16-row level the profile's shape was off by 7-19%
    there, and the calibration could not price it (docs/simulator.md). The result then has ``"loaded": [streams,
    rounds]``.
    """
    import random
    import statistics

    rng = random.Random(f"calibrate-{seed}")

    def fresh(n: int) -> list:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    from kvserve.sim.cost_model import decode_features, prefill_features

    def median_gap(b: int, what: str) -> float:
        """The median inter-token gap of ``b`` concurrent fresh streams, ``decode_runs`` times (first 3 gaps of
        each stream dropped)."""
        gaps = []
        for _ in range(decode_runs):
            reqs = [LoadRequest(fresh(context), output_len, 0.0) for _ in range(b)]
            results, _ = asyncio.run(run_benchmark(base_url, model, reqs, [0.0] * b))
            gaps += [g for r in results if r.success for g in r.itl[3:]]
        if not gaps:
            raise ValueError(f"calibration {what} got no inter-token gaps: {[r.error for r in results]}")
        return statistics.median(gaps)

    points = []
    if prefill_runs < 1 or decode_runs < 1:
        raise ValueError(f"calibration runs must be >= 1, got prefill_runs={prefill_runs}, decode_runs={decode_runs}")
    t_start = time.monotonic()
    for b in (1, 8):
        rows = -(-b // replicas)
        points.append((b, median_gap(b, f"at batch {b}"),
                       cost.step_time(decode_features(rows, context + output_len // 2))))
    (_, m1, p1), (_, m8, p8) = points
    contention = None
    if replicas > 1:  # k one-row streams at once, one per replica: the same step with k replicas busy
        contention = [1.0] + [max(1.0, median_gap(k, f"with {k} replicas busy") / m1)  # below 1: noise
                              for k in range(2, replicas + 1)]
        m8 /= contention[min(8, replicas) - 1]  # the 8 streams kept min(8, replicas) replicas busy
    scale = (m8 - m1) / (p8 - p1) if p8 > p1 else 0.0
    offset = m1 - scale * p1
    if not scale > 0 or offset < 0:  # not two consistent points: a pure ratio
        scale, offset = (m1 + m8) / (p1 + p8), 0.0
    ttfts = []
    for i in range(prefill_runs):  # one at a time: each prompt is a step of its own
        req = LoadRequest(fresh(prefill_len), 2, 0.0)
        results, _ = asyncio.run(run_benchmark(base_url, model, [req], [0.0]))
        ttfts += [r.ttft for r in results if r.success]
    if not ttfts:
        raise ValueError("calibration of the prefill step got no successful request")
    f = prefill_features(prefill_len)
    measured, pre = statistics.median(ttfts), cost.prefill_time(f)
    rest = offset + scale * (cost.step_time(f) - pre)
    prefill_scale = (measured - rest) / pre if pre > 0 and measured > rest else None
    cal = {"offset_s": offset, "scale": scale, "prefill_scale": prefill_scale, "points": points,
           "prefill_points": [(prefill_len, measured, cost.step_time(f))]}
    if contention is not None:
        cal["contention"] = contention
    if step_trace_path is None:
        return cal
    burst = [LoadRequest(fresh(prefill_len), output_len, 0.0 if i < 4 else 0.1 * (i - 3)) for i in range(12)]
    asyncio.run(run_benchmark(base_url, model, burst, [r.arrival_s for r in burst]))
    if loaded_streams > 0 and loaded_rounds > 0:
        sessions = [[LoadRequest(fresh(rng.randint(prefill_len // 4, prefill_len)), output_len, 0.0)
                     for _ in range(loaded_rounds)] for _ in range(loaded_streams)]
        stagger = output_len * m8 / loaded_streams  # one request's time at 8 rows, spread over the streams
        asyncio.run(run_sessions(base_url, model, sessions, [i * stagger for i in range(loaded_streams)]))
        cal["loaded"] = [loaded_streams, loaded_rounds]
    steps = [st for st in read_idle_trace(step_trace_path) if st[0] >= t_start]
    return {**cal, **fit_from_steps(steps, cost), "fit": "server steps", "window": (t_start, time.monotonic())}


def warm_up_server(base_url: str, model: str, seconds: float) -> int:
    """Send rounds of 4 concurrent fresh 40-token prompts (16 output tokens each) to the server until ``seconds``
    have passed (at least one round), before anything is measured: a fresh process's first seconds can run far
    slower than the rest (``kvserve.sim.profile.warm_up``). Returns the requests sent. The prompts (ids 2000-5038,
    none repeated) are not the calibration's (drawn at random) or the trace's."""
    t_end, sent = time.monotonic() + seconds, 0
    while True:
        warm = [LoadRequest([2000 + (sent + i) * 41 % 3000 + k for k in range(40)], 16, 0.0) for i in range(4)]
        asyncio.run(run_benchmark(base_url, model, warm, [0.0] * 4))
        sent += 4
        if time.monotonic() >= t_end:
            return sent


def read_idle_trace(path, timeout: float = 30.0) -> list:
    """The server's step trace once it has gone idle: the server writes its buffered lines when its loop idles, so
    this reads ``path`` until the last step left nothing unfinished (``more`` false), for at most ``timeout``
    seconds (then what is there)."""
    deadline = time.monotonic() + timeout
    while True:
        steps = read_step_trace(path)
        if (steps and not steps[-1][2]) or time.monotonic() > deadline:
            return steps
        time.sleep(0.1)


def loop_turns(steps: list) -> list:
    """``(turn_s, rows)`` per step of a step trace (``kvserve.sim.trace.read_step_trace`` tuples): from a step's start
    to the next one's where the loop went straight on (``more``), the step alone otherwise."""
    return [((steps[k + 1][0] if more and k + 1 < len(steps) else t1) - t0, rows)
            for k, (t0, t1, more, rows) in enumerate(steps)]


def fit_from_steps(steps: list, cost, weights: list | None = None) -> dict:
    """``offset_s``, ``scale`` and ``prefill_scale`` of ``ServerCalibrated`` fitted to a server's loop turns: ``turn
    = offset + scale * (predicted - prefill part) + prefill_scale * prefill part`` per step, by non-negative least
    squares on relative error (``cost_model.nnls_relative``).

    Args:
        steps: ``kvserve.sim.trace.read_step_trace`` tuples (at least 3 steps, some with prompt chunks).
        cost: the uncalibrated ``CostModel``.
        weights: one per step, >= 0 (``kvserve.sim.step_mix.matched_weights``): how much its relative error counts;
            steps of weight 0 are left out. ``None``: all alike.

    Returns:
        ``{"offset_s", "scale", "prefill_scale", "steps", "mean_abs_rel_err"}``; ``prefill_scale`` is ``None``
        when no step had a prefill part.

    Raises:
        ValueError: fewer than 3 steps (of weight > 0).
    """
    from kvserve.sim.cost_model import nnls_relative, row_features

    if weights is None:
        weights = [1.0] * len(steps)
    turns = [(t, row_features(rows), w) for (t, rows), w in zip(loop_turns(steps), weights) if t > 0 and w > 0]
    if len(turns) < 3:
        raise ValueError(f"the server's step trace has {len(turns)} steps in the calibration; need at least 3")
    x = []
    for _, f, _ in turns:
        pre = cost.prefill_time(f)
        x.append([1.0, cost.step_time(f) - pre, pre])
    y = [t for t, _, _ in turns]
    w = [v for _, _, v in turns]
    has_prefill = any(r[2] > 0 for r in x)  # else the prefill column is all zeros and its coefficient 0
    offset, scale, prefill_scale = nnls_relative(x, y, sample_weight=w)
    pred = [offset + scale * a + prefill_scale * b for _, a, b in x]
    err = sum(v * abs(p - t) / t for p, t, v in zip(pred, y, w)) / sum(w)
    if not scale > 0:
        raise ValueError("the server's calibration steps give no positive scale for the cost model; profile again")
    return {"offset_s": offset, "scale": scale, "prefill_scale": prefill_scale if has_prefill else None,
            "steps": len(y), "mean_abs_rel_err": err}


def calibrate_profile(base_url: str, model: str, engine_args: dict, profile_path, seed: int = 0,
                      replicas: int = 1, runs: int = 3, step_trace_path: str | None = None,
                      loaded_rounds: int = 0) -> tuple:
    """``calibrate`` the live server at ``base_url`` against the profile's uncalibrated cost model (``runs`` lone
    prefills, each decode batch measured ``runs // 3`` times, at least once; with ``step_trace_path`` and
    ``loaded_rounds``, a loaded phase of ``max_num_seqs`` streams), print the result, store it as the
    profile's ``server_calibration`` (the file is rewritten) and return ``(Simulator with it, the calibration
    dict)``."""
    from kvserve.sim.cli import build_simulator

    raw_sim, prof = build_simulator(engine_args, profile_path, server_calibration=False)
    cal = calibrate(base_url, model, raw_sim.step_time, seed=seed, replicas=replicas, prefill_runs=runs,
                    decode_runs=max(1, runs // 3), step_trace_path=step_trace_path,
                    loaded_streams=raw_sim.config.scheduler_config.max_num_seqs * replicas,
                    loaded_rounds=loaded_rounds)
    ps = cal["prefill_scale"]
    print(f"server calibration: step = {cal['offset_s'] * 1000:.1f} ms + {cal['scale']:.3f} x engine step "
          f"(prefill terms x {ps if ps is None else round(ps, 3)}; measured / predicted decode step: " +
          ", ".join(f"{b} stream{'s' if b > 1 else ''} {m * 1000:.0f} / {p * 1000:.0f} ms"
                    for b, m, p in cal["points"]) +
          (f"; decode step-time factor with 1..{len(cal['contention'])} replicas busy: "
           + ", ".join(f"{c:.2f}" for c in cal["contention"]) if cal.get("contention") else "") +
          "; lone prefill: " +
          ", ".join(f"{n} tokens {m * 1000:.0f} / {p * 1000:.0f} ms" for n, m, p in cal["prefill_points"]) +
          ")" + (f"; loaded phase: {cal['loaded'][0]} streams x {cal['loaded'][1]} requests" if cal.get("loaded")
                 else "") +
          (f"; fitted on the server's {cal['steps']} steps, mean |error| {100 * cal['mean_abs_rel_err']:.1f}%"
           if cal.get("fit") else ""), flush=True)
    prof["server_calibration"] = {**cal, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(profile_path, "w") as f:
        json.dump(prof, f, indent=1)
    return build_simulator(engine_args, profile_path)[0], prof["server_calibration"]


def step_comparison(steps: list, cost, t_start: float, t_end: float) -> dict:
    """The server's own steps between ``t_start`` and ``t_end`` (monotonic seconds;
    ``kvserve.sim.trace.read_step_trace`` tuples) against ``cost``'s prediction for the very same plans.

    Returns ``{"steps", "step_s", "turn_s", "predicted_s", "turn_error", "by_kind"}``: the number of steps, their
    total time inside ``engine.step`` and as whole loop turns (a step's start to the next one's, where the loop did
    not idle between them; the step alone otherwise), the total predicted, ``(predicted - turn) / turn``, and the
    same three totals per kind of step (``decode``: single-token rows only; ``mixed``: a prompt chunk with decode
    rows; ``prefill``: prompt chunks only).
    """
    from kvserve.sim.cost_model import row_features
    from kvserve.sim.step_mix import step_kind

    sel = [s for s in steps if t_start <= s[0] <= t_end]
    out = {"steps": len(sel), "step_s": 0.0, "turn_s": 0.0, "predicted_s": 0.0, "by_kind": {}}
    for (t0, t1, _, rows), (turn, _) in zip(sel, loop_turns(sel)):
        pred = cost.step_time(row_features(rows))
        kind = step_kind(rows)
        agg = out["by_kind"].setdefault(kind, {"steps": 0, "step_s": 0.0, "turn_s": 0.0, "predicted_s": 0.0})
        for d in (out, agg):
            d["step_s"] += t1 - t0
            d["turn_s"] += turn
            d["predicted_s"] += pred
        agg["steps"] += 1
    out["turn_error"] = (out["predicted_s"] - out["turn_s"]) / out["turn_s"] if out["turn_s"] else None
    return out


def level_fitted(raw_sim, steps: list, t_start: float, t_end: float, trace: list, slos, real: dict) -> tuple:
    """The level replayed with a cost model fitted afterwards on the level's own server steps: ``fit_from_steps``
    over the steps between ``t_start`` and ``t_end`` (monotonic seconds), then the same requests through a
    ``Simulator`` with that ``ServerCalibrated`` model.

    Not a prediction (the level's timing is an input): with three numbers fitted on tens to hundreds of steps, what is
    left of the error is the simulator's own (its cost model's shape, the scheduler replay, the queueing), apart
    from the machine's speed moving between the calibration and the level.

    Returns:
        ``(fit, comparison)``: ``fit_from_steps``'s dict and ``compare(real, simulated)``.

    Raises:
        ValueError: fewer than 3 server steps in the level.
    """
    fit = fit_from_steps([s for s in steps if t_start <= s[0] <= t_end], raw_sim.step_time)
    return fit, compare(real, replay(raw_sim, fit, trace, slos))


def match_mix(raw_sim, cal: dict, steps: list, trace: list, slos, real: dict, report: dict) -> dict:
    """``--match-mix`` for one level: ``kvserve.sim.step_mix.predict_matched`` over the server's ``steps`` in the
    calibration's window; prints the fit and the comparison, adds ``mix_fit``, ``mix_times_s`` and
    ``errors_mix_matched`` to the level's ``report`` and returns ``compare(real, replay)``."""
    from kvserve.sim.step_mix import predict_matched

    w0, w1 = cal["window"]
    fit, summary, times = predict_matched(raw_sim, cal, [s for s in steps if w0 <= s[0] <= w1], trace, slos)
    comp = compare(real, summary)
    report.update({"mix_fit": fit, "mix_times_s": times, "errors_mix_matched": {k: v[2] for k, v in comp.items()}})
    total = sum(times.values())
    print(f"{report['rate']:g} req/s, calibration refitted to the level's simulated step mix (" +
          ", ".join(f"{k} {100 * t / total:.0f}%" for k, t in times.items() if t >= 0.02 * total) +
          f"): offset {1e3 * fit['offset_s']:.1f} ms, scale {fit['scale']:.3f}, prefill scale "
          f"{fit['prefill_scale'] if fit['prefill_scale'] is None else round(fit['prefill_scale'], 3)}", flush=True)
    print(format_comparison([(f"{report['rate']:g} req/s mix-matched", comp)]), flush=True)
    return comp


def replay(raw_sim, cal: dict, trace: list, slos) -> dict:
    """``trace`` through a ``Simulator`` like ``raw_sim`` whose cost model is ``raw_sim``'s seen through the
    calibration ``cal`` (``offset_s``, ``scale``, ``prefill_scale``: ``ServerCalibrated``); its summary."""
    from kvserve.sim.cost_model import ServerCalibrated
    from kvserve.sim.simulator import Simulator

    cost = ServerCalibrated(raw_sim.step_time, cal["offset_s"], cal["scale"], cal["prefill_scale"])
    return Simulator(raw_sim.config, cost, raw_sim.num_blocks, raw_sim.max_model_len).run(trace, slos).summary


def mean_calibration(before: dict, after: dict) -> dict:
    """The calibration halfway between two (``--bracket``): the mean of each of ``offset_s``, ``scale`` and
    ``prefill_scale`` (a step's calibrated time is linear in them, so this is the mean of the two predicted times of
    every step); a ``prefill_scale`` of ``None`` (nothing measured) leaves the other one's."""
    ps = [c["prefill_scale"] for c in (before, after) if c.get("prefill_scale") is not None]
    return {"offset_s": (before["offset_s"] + after["offset_s"]) / 2, "scale": (before["scale"] + after["scale"]) / 2,
            "prefill_scale": sum(ps) / len(ps) if ps else None}


def format_step_comparison(name: str, c: dict) -> str:
    """One line per kind of step of a ``step_comparison``: steps, ms inside ``engine.step``, per loop turn, and
    predicted, per step."""
    lines = [f"{name}: server steps vs the cost model on the same plans (ms per step: in engine.step / loop turn / "
             f"predicted)"]
    for kind, d in sorted(c["by_kind"].items()):
        n = d["steps"]
        err = (d["predicted_s"] - d["turn_s"]) / d["turn_s"]
        lines.append(f"  {kind:<8}{n:>6} steps  {1e3 * d['step_s'] / n:8.1f} {1e3 * d['turn_s'] / n:8.1f} "
                     f"{1e3 * d['predicted_s'] / n:8.1f}  ({100 * err:+.1f}%)")
    return "\n".join(lines)


def per_request(trace: list, records: list, simulated: list) -> list:
    """One row per request of a level, in send order: ``[send offset s, prompt tokens, output tokens, real TTFT s,
    simulated TTFT s, real e2e s, simulated e2e s]`` (``None`` where a request failed), so a level's miss can be
    traced to the requests that make it (``--output-json``). ``records``: ``request_records`` of the level (the
    real side), ``trace``: ``trace_from_records`` of them, ``simulated``: the simulator's results for ``trace``."""
    def r6(v):
        return None if v is None else round(v, 6)

    real = sorted((r for r in records if r.get("start_s") is not None), key=lambda r: r["start_s"])  # trace order
    return [[r6(t.arrival_s), t.prompt_len, t.output_len, r6(a["ttft"] if a["success"] else None),
             r6(b.ttft if b.success else None), r6(a["e2el"] if a["success"] else None),
             r6(b.e2el if b.success else None)]
            for t, a, b in zip(trace, real, simulated)]


def mean_metrics(summaries: list) -> dict:
    """The mean of each of ``METRICS`` over several runs' summaries (``None`` where any run lacks it)."""
    out = {}
    for key, _ in METRICS:
        vals = [s.get(key) for s in summaries]
        out[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    return out


def compare(real: dict, sim: dict) -> dict:
    """``{metric: (real, sim, relative error)}`` for ``METRICS`` (error ``(sim - real) / real``)."""
    out = {}
    for key, _ in METRICS:
        r, s = real.get(key), sim.get(key)
        err = (s - r) / r if r and s is not None else None
        out[key] = (r, s, err)
    return out


def format_comparison(rows: list) -> str:
    """Rows of ``(level name, comparison)`` as a text table."""
    lines = [f"{'level':<22}{'metric':<16}{'real':>10}{'sim':>10}{'error':>9}"]
    for name, comp in rows:
        for key, label in METRICS:
            r, s, e = comp[key]
            lines.append(f"{name:<22}{label:<16}{r if r is not None else float('nan'):>10.1f}"
                         f"{s if s is not None else float('nan'):>10.1f}"
                         f"{(100 * e if e is not None else float('nan')):>8.1f}%")
    return "\n".join(lines)


def progress(message: str) -> None:
    """One line on stderr about what the command is doing now (the tables go to stdout)."""
    print(f"sim validate: {message}", file=sys.stderr, flush=True)


def warn_thread_mismatch(prof: dict, engine_args: dict) -> bool:
    """Print a warning (stderr) when the server this command starts would run its kernels on another number of
    threads than the profile's engine did: the cost model's step times then differ from the server's by about that
    ratio (a profile made on 2 threads against a 1-thread server: prefill steps ~48% off). Returns whether it
    warned. Profiles without ``torch_threads`` are not checked."""
    import torch

    made = prof.get("torch_threads")
    serving = engine_args.get("num_threads") or torch.get_num_threads()  # the server's default is this process's
    if not made or made == serving:
        return False
    print(f"warning: the profile was made with {made} threads ({prof.get('created', '?')}), and the server started "
          f"here runs with {serving} (--num-threads): the cost model's steps will be off by about that ratio. Make "
          f"the profile with `kvserve sim profile --num-threads {serving}`, or pass --num-threads {made}.",
          file=sys.stderr, flush=True)
    return True


def run(args: argparse.Namespace) -> int:
    """``kvserve sim validate``: see the module docstring. A SIGTERM ends it through its ``finally`` blocks (the
    server it started is stopped, its temporary step trace removed); the server also gets SIGTERM if this process
    dies some other way (``kvserve.bench.server_process``)."""
    with sigterm_as_exit():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """``kvserve sim validate``."""
    from kvserve.sim.cli import build_simulator

    logging.getLogger("httpx").setLevel(logging.WARNING)
    rates = parse_list(args.rates, "rates", float)  # an empty or non-numeric entry: an error naming --rates
    if any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be positive numbers, got {args.rates!r}")
    slos = parse_goodput(args.goodput)
    if args.calibration_runs < 1:
        raise ValueError(f"--calibration-runs must be >= 1, got {args.calibration_runs}")
    if args.real_repeats < 1:
        raise ValueError(f"--real-repeats must be >= 1, got {args.real_repeats}")
    if args.calibration_loaded_rounds < 0:
        raise ValueError(f"--calibration-loaded-rounds must be >= 0, got {args.calibration_loaded_rounds}")
    check_warmup_s(args.warmup_s)
    if args.bracket and not (args.save_calibration and args.calibrate_each_level):
        raise ValueError("--bracket needs --save-calibration and --calibrate-each-level (it replays each level with "
                         "the calibrations measured before and after it)")
    if args.match_mix and not args.save_calibration:
        raise ValueError("--match-mix needs --save-calibration (it refits the calibration's own server steps)")
    if (args.fit_each_level or args.match_mix) and args.base_url is not None and args.step_trace is None:
        raise ValueError(f"{'--fit-each-level' if args.fit_each_level else '--match-mix'} needs the server's step "
                         "trace: with --base-url, pass --step-trace FILE (the file that server writes)")
    eargs = {k: v for k, v in engine_kwargs(args).items() if k != "device"}
    levels = [level_requests(args, rate, args.seed + i) for i, rate in enumerate(rates)]  # bad data: before serving
    sim, prof = build_simulator(eargs, args.profile)
    if args.base_url is None:
        warn_thread_mismatch(prof, eargs)
    raw_sim, _ = build_simulator(eargs, args.profile, server_calibration=False)
    proc, tmp_dir = None, None
    trace_path = args.step_trace
    if args.base_url is None:
        if trace_path is None:  # removed at the end: pass --step-trace to keep it
            tmp_dir = tempfile.mkdtemp(prefix="kvserve-validate-")
            trace_path = os.path.join(tmp_dir, "steps.jsonl")
        try:
            progress("starting kvserve serve (loading the model)")
            proc, base_url = start_server({k: v for k, v in eargs.items() if k != "speculative_config"},
                                          step_trace=trace_path)
        except BaseException:
            if tmp_dir is not None:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    else:
        base_url = args.base_url
    rows, report, bracketed, matched, repeated, averaged = [], [], [], [], [], []
    pending = []  # (name, trace, real) of the level still to bracket
    try:
        model = fetch_model(base_url)
        progress(f"server ready at {base_url}; warming it up for {args.warmup_s:g} s")
        warm_up_server(base_url, model, args.warmup_s)

        def recalibrate(level: int = 0):
            return calibrate_profile(base_url, model, eargs, args.profile, seed=args.seed * 1000 + level,
                                     runs=args.calibration_runs, step_trace_path=trace_path,
                                     loaded_rounds=args.calibration_loaded_rounds)

        def bracket(after: dict) -> None:  # the level just run, between its calibration and ``after``
            name, trace, real = pending.pop()
            mean = mean_calibration(report[-1]["server_calibration"], after)
            comp = compare(real, replay(raw_sim, mean, trace, slos))
            bracketed.append((name, comp))
            report[-1].update({"calibration_after": after, "calibration_bracketed": mean,
                               "errors_bracketed": {k: v[2] for k, v in comp.items()}})
            print(format_comparison([(name + " bracketed", comp)]), flush=True)

        cal = prof.get("server_calibration")
        if args.save_calibration:
            progress("calibrating the cost model against the server")
            sim, cal = recalibrate()
        for i, rate in enumerate(rates):
            if args.save_calibration and args.calibrate_each_level and i > 0:
                progress("calibrating the cost model against the server")
                sim, cal = recalibrate(i)
                if args.bracket:
                    bracket(cal)
            progress(f"level {i + 1} of {len(rates)}: {len(levels[i])} requests at {rate:g} req/s")
            real, records, trace, t_start, t_end = run_level(base_url, model, levels[i], slos, args.max_duration)
            sim_result = sim.run(trace, slos)
            simulated = sim_result.summary
            raw = raw_sim.run(trace, slos).summary
            name = f"{rate:g} req/s"
            comp = compare(real, simulated)
            rows.append((name, comp))
            report.append({"rate": rate, "seed": args.seed + i, "window": (t_start, t_end), "server_calibration": cal,
                           "real": real, "sim": simulated, "sim_uncalibrated": raw,
                           "errors": {k: v[2] for k, v in comp.items()},
                           "errors_uncalibrated": {k: v[2] for k, v in compare(real, raw).items()},
                           "requests": per_request(trace, records, sim_result.results)})
            print(format_comparison([(name, comp)]), flush=True)
            if args.bracket:
                pending.append((name, trace, real))
            if trace_path is not None:
                steps = read_idle_trace(trace_path)
                steps_cmp = step_comparison(steps, sim.step_time, t_start, t_end)
                report[-1]["server_steps"] = steps_cmp
                print(format_step_comparison(name, steps_cmp), flush=True)
                if args.fit_each_level:
                    fit, fitted_comp = level_fitted(raw_sim, steps, t_start, t_end, trace, slos, real)
                    report[-1].update({"level_fit": fit, "errors_level_fitted": {k: v[2] for k, v in
                                                                                  fitted_comp.items()}})
                    print(f"{name}, replayed with the cost model fitted on this level's {fit['steps']} server steps "
                          f"(offset {1e3 * fit['offset_s']:.1f} ms, scale {fit['scale']:.3f}, prefill scale "
                          f"{fit['prefill_scale'] if fit['prefill_scale'] is None else round(fit['prefill_scale'], 3)}"
                          f"; mean |step error| {100 * fit['mean_abs_rel_err']:.1f}%):", flush=True)
                    print(format_comparison([(name + " fitted", fitted_comp)]), flush=True)
                if args.match_mix:
                    matched.append((name + " mix-matched", match_mix(raw_sim, cal, steps, trace, slos, real,
                                                                     report[-1])))
            if args.real_repeats > 1:
                report[-1]["repeats"] = repeat_level(base_url, model, levels[i], sim, slos, real, args,
                                                     seed=(args.seed + i) * 1000 + 7, name=name)
                repeated.extend((f"{name} run {j + 2}", compare(real, rep["real"]))
                                for j, rep in enumerate(report[-1]["repeats"]))
                runs = [(real, simulated)] + [(rep["real"], rep["sim"]) for rep in report[-1]["repeats"]]
                comp_mean = compare(mean_metrics([r for r, _ in runs]), mean_metrics([s for _, s in runs]))
                report[-1]["errors_mean_of_runs"] = {k: v[2] for k, v in comp_mean.items()}
                averaged.append((f"{name} x{len(runs)} mean", comp_mean))
        if args.bracket:
            bracket(recalibrate(len(rates))[1])
    finally:
        if proc is not None:
            stop_server(proc)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    print("\nevery level, predicted (the rows printed with each level above, together):")
    print(format_comparison(rows))
    if args.bracket:
        print("\neach level replayed with the mean of the calibrations just before and just after it:")
        print(format_comparison([(name + " bracketed", c) for name, c in bracketed]))
    if matched:
        print("\neach level replayed with its calibration refitted to the step mix simulated for it:")
        print(format_comparison(matched))
    if repeated:
        print("\neach level's slice run again on the real server ('real': its first run, 'sim': the repeat):")
        print(format_comparison(repeated))
        print(f"\neach metric averaged over the level's {args.real_repeats} real runs, against its average over their "
              "simulated replays:")
        print(format_comparison(averaged))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"profile": args.profile, "engine_args": eargs, "levels": report}, f, indent=1, default=str)
    return 0
