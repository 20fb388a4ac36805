"""``python -m benchmarks.serve_peers``: served over HTTP, ``kvserve serve`` and ``vllm serve`` side by side under the
same client, ``kvserve bench serve`` (``kvserve.bench.serve``).

Each server configuration is started in its own process (kvserve: ``python -m kvserve.entrypoints.cli serve``;
vLLM: ``python -m vllm.entrypoints.openai.api_server`` from its venv, ``--dtype`` bfloat16 by default, on the float32
Hugging Face directory ``benchmarks.peers`` prepares; both ``--num-threads`` threads), then driven at each
``--request-rates`` value (Poisson arrivals; ``inf``: all at once) with ``--num-prompts`` requests of random token
ids, ``--input-len`` / ``--output-len`` tokens (vLLM's random dataset lengths, EOS ignored), streamed, greedy. Every
run uses a fresh ``--seed`` (base + run index), so no run meets an earlier run's prompts in the prefix cache. Goodput
counts the requests meeting ``--goodput`` (default TTFT <= 2 s and TPOT <= 150 ms). Servers run one at a time
(an idle server still takes memory and may poll); with ``--rounds`` > 1 the engines alternate.

Results: docs/performance.md ("Many users: against vLLM-CPU and OpenVINO").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peers

ENGINES = ("kvserve", "vllm")
DEFAULT_KVSERVE = ("default:",)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_server_config(spec: str) -> tuple:
    """``"LABEL:--flag value ..."`` -> ``(label, [flags])`` (shell-split).

    Raises:
        ValueError: no ``:`` or an empty label.
    """
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise ValueError(f"a server configuration is LABEL:FLAGS, got {spec!r}")
    return label, shlex.split(rest)


def server_command(engine: str, args, flags: list, port: int, model_dir) -> tuple:
    """``(argv, env)`` starting ``engine``'s OpenAI-compatible server on ``127.0.0.1:port``.

    Raises:
        ValueError: the engine's venv or weights are missing (the reason).
    """
    if engine == "kvserve":
        argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--no-access-log", "--num-threads", str(args.num_threads), *flags]
        return argv, peers.engine_env("kvserve", args.num_threads, args.vllm_kv_gb)
    py, why = peers.peer_python(args.peers_dir, "vllm")
    if py is None or model_dir is None:
        raise ValueError(why or "no Hugging Face directory for vLLM")
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", args.vllm_dtype,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
            str(args.input_len + args.output_len + 64), *flags]
    return argv, peers.engine_env("vllm", args.num_threads, args.vllm_kv_gb)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``GET /v1/models`` answers 200.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` s.
    """
    import httpx

    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                return time.perf_counter() - t
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer within {timeout} s")


def bench_once(base_url: str, args, rate: float, seed: int, out_json: Path) -> dict:
    """One ``kvserve bench serve`` run at ``rate`` req/s with ``seed``; its JSON summary (requests dropped)."""
    from kvserve.bench import serve

    p = argparse.ArgumentParser()
    serve.add_args(p)
    bench_args = p.parse_args(["--base-url", base_url, "--dataset", "random", "--random-input-len",
                               str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
                               str(args.num_prompts), "--request-rate", str(rate), "--seed", str(seed),
                               "--ignore-eos", "--goodput", *args.goodput, "--output-json", str(out_json),
                               "--quiet", "--request-timeout", str(args.request_timeout)])
    serve.run(bench_args)
    report = json.loads(out_json.read_text())
    report.pop("requests", None)
    return report


def vllm_client_once(base_url: str, args, rate: float, seed: int, model: str, tokenizer, tmp: Path) -> dict:
    """One run of vLLM's own client (``vllm.benchmarks.serve`` in the vLLM venv, its random dataset, the same
    lengths, rate, seed and SLOs), its summary in ``kvserve bench serve``'s key names.

    Raises:
        RuntimeError: the client failed (its last lines).
    """
    py, why = peers.peer_python(args.peers_dir, "vllm")
    if py is None or tokenizer is None:
        raise RuntimeError(why or "vLLM's client needs the Hugging Face directory's tokenizer")
    argv = ["--backend", "vllm", "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--seed",
            str(seed), "--ignore-eos", "--goodput", *args.goodput, "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--disable-tqdm"]
    res = peers.run_worker(py, "vllm_bench_serve", {"argv": argv}, tmp, peers.base_env(args.num_threads),
                           args.request_timeout)
    if "error" in res:
        raise RuntimeError(f"vLLM's client: {res['error']}")
    out = {k: res.get(k) for k in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")}
    out.update(goodput=res.get("request_goodput"), failed=res.get("failed", 0), prefix_cache_hit_rate=None,
               client="vllm")
    return out


def run_server(engine: str, label: str, flags: list, args, model_dir, tmp: Path, seeds) -> dict:
    """Start one server, run every rate against it, stop it; ``{"label", "ready_s", "runs": [...]}`` or with
    ``error``."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    try:
        argv, env = server_command(engine, args, flags, port, model_dir)
    except ValueError as e:
        return {"label": label, "error": str(e)}
    log = open(tmp / f"{label.replace(' ', '_')}-{port}.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=peers.ROOT)
    out = {"label": label, "engine": engine, "runs": []}
    try:
        out["ready_s"] = wait_ready(base_url, proc, args.start_timeout)
        model = None
        for rate in args.request_rates:
            for client in args.client:
                seed = next(seeds)
                t = time.perf_counter()
                if client == "kvserve":
                    rep = bench_once(base_url, args, rate, seed, tmp / f"run-{seed}.json")
                    rep["client"] = "kvserve"
                else:
                    from kvserve.bench.serve import fetch_model

                    model = model or fetch_model(base_url)
                    rep = vllm_client_once(base_url, args, rate, seed, model, model_dir, tmp)
                rep.update(rate=rate, seed=seed, wall_s=time.perf_counter() - t)
                out["runs"].append(rep)
            print(f"{label} rate {rate}: {json.dumps({k: v for k, v in rep.items() if k != 'config'})}", flush=True)
    except (RuntimeError, ValueError, OSError) as e:
        log.flush()
        tail = Path(log.name).read_text().strip().splitlines()[-3:]
        out["error"] = f"{e} | {' | '.join(tail)}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def _f(v, spec=".0f"):
    return "n/a" if v is None else f"{v:{spec}}"


def format_table(servers: list, goodput: list) -> str:
    """Markdown table: one row per server run and rate."""
    head = ["server", "client", "rate req/s", "req/s", "output tok/s", f"goodput req/s ({' '.join(goodput)})",
            "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "failed", "prefix hits"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for s in servers:
        if "error" in s and not s.get("runs"):
            out.append(f"| {s['label']} | skipped: {s['error']} |" + " |" * (len(head) - 2))
            continue
        for r in s["runs"]:
            hit = r.get("prefix_cache_hit_rate")
            out.append("| " + " | ".join([
                s["label"], r.get("client", "kvserve"), "inf" if math.isinf(r["rate"]) else f"{r['rate']:g}", _f(r["request_throughput"], ".2f"),
                _f(r["output_throughput"]), _f(r["goodput"], ".2f"),
                f"{_f(r['median_ttft_ms'])} / {_f(r['p99_ttft_ms'])}",
                f"{_f(r['median_tpot_ms'])} / {_f(r['p99_tpot_ms'])}",
                f"{_f(r['median_itl_ms'])} / {_f(r['p99_itl_ms'])}", str(r["failed"]),
                "n/a" if hit is None else f"{100 * hit:.1f}%"]) + " |")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", type=peers._csv(str), default=list(ENGINES), help=f"comma-separated, of {ENGINES}")
    p.add_argument("--kvserve", action="append", default=None, metavar="LABEL:FLAGS",
                   help=f"a kvserve serve configuration, e.g. 'b2048:--max-num-batched-tokens 2048' (repeatable; "
                        f"default {list(DEFAULT_KVSERVE)})")
    p.add_argument("--vllm-flags", default="", help="more flags for vLLM's server")
    p.add_argument("--client", type=peers._csv(str), default=["kvserve"],
                   help="comma-separated, of kvserve (kvserve bench serve) and vllm (vLLM's own client, its random "
                        "dataset, run as a library in the vLLM venv): each runs every rate with its own seed")
    p.add_argument("--request-rates", type=peers._csv(float), default=[1.0, 2.0, 4.0, math.inf],
                   help="comma-separated req/s; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:150"], metavar="METRIC:MS")
    p.add_argument("--rounds", type=int, default=1, help="each server configuration once per round, alternating")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR, help="as benchmarks.peers'")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "kvserve-peers"),
                   help="prepared weights (benchmarks.peers')")
    p.add_argument("--seed", type=int, default=1000, help="first run's seed; each later run adds one")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to start")
    p.add_argument("--request-timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None, help="also write every run's summary to this file")
    args = p.parse_args(argv)
    args.kvserve = args.kvserve or list(DEFAULT_KVSERVE)
    bad = [e for e in args.engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; allowed: {', '.join(ENGINES)}")
    bad = [c for c in args.client if c not in ("kvserve", "vllm")]
    if bad or not args.client:
        p.error(f"--client: unknown {bad}; allowed: kvserve, vllm")
    if min(args.num_prompts, args.input_len, args.output_len, args.rounds, args.num_threads) < 1:
        p.error("--num-prompts, --input-len, --output-len, --rounds and --num-threads must be >= 1")
    if not args.request_rates or min(args.request_rates) <= 0:
        p.error("--request-rates must be > 0 (or inf)")
    try:
        for spec in args.kvserve:
            parse_server_config(spec)
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> int:
    """Every server configuration at every rate, in ``args.rounds`` alternating rounds; prints the table."""
    import itertools

    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    configs = [("kvserve", *parse_server_config(s)) for s in args.kvserve] if "kvserve" in args.engines else []
    model_dir = None
    with tempfile.TemporaryDirectory(prefix="kvserve-serve-peers-") as tmp:
        if "vllm" in args.engines or "vllm" in args.client:
            model_dir, why = peers.hf_dir(argparse.Namespace(peers_dir=args.peers_dir, work_dir=args.work_dir,
                                                             num_threads=args.num_threads, timeout=1800.0),
                                          Path(tmp))
            if "vllm" in args.engines:
                configs.append(("vllm", f"vLLM-CPU ({args.vllm_dtype})", shlex.split(args.vllm_flags)))
            if why:
                print(f"vLLM: {why}", flush=True)
        seeds = itertools.count(args.seed)
        servers = []
        for r in range(args.rounds):
            for engine, label, flags in peers._order(configs, r):
                servers.append(run_server(engine, label if engine != "kvserve" else f"kvserve ({label})", flags,
                                          args, model_dir, Path(tmp), seeds))
    print(f"\n{args.num_prompts} requests of {args.input_len} random prompt / {args.output_len} output tokens per "
          f"run (EOS ignored), greedy, streamed, {args.num_threads} threads per server, a fresh seed per run\n")
    print(format_table(servers, args.goodput))
    for s in servers:
        if s.get("ready_s") is not None:
            print(f"- {s['label']}: ready {s['ready_s']:.0f} s after its start" + (
                f"; error: {s['error']}" if "error" in s else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(servers, indent=2, default=str))
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
