"""Batch invariance at no cost, measured: this checkout against another one (say, the commit before attention went
all through the kernel), side by side in one run.

    git worktree add /tmp/before 8873c82      # the last commit where long prompt chunks ran gather + SDPA
    python -m benchmarks.invariance --baseline /tmp/before [--rounds 3]

Each round runs one measuring process per checkout, alternating (the baseline first), on the default engine
(quantized weights, prefix caching off so repeats are not cache hits), and prints the medians over the rounds and
the ratio this / baseline:

- ``prefill_1000_s``: a 1,000-token prompt to its first token (one output token);
- ``throughput_tok_s``: 64 requests of 128 prompt tokens and 128 output tokens (EOS ignored), output tokens per s;
- ``decode_b1_ms``: batch-1 decode, ms per output token (a 128-token prompt, 129 tokens minus 1, over 128);
- ``attn_1000_ms``: one layer's attention of a 1,000-token prompt through the model's attention backend, and
  ``attn_share``: that times the layer count over ``prefill_1000_s``.
Results: docs/performance.md, "Batch invariance".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: The measuring process, run in a checkout (its ``kvserve`` on ``sys.path``); prints one JSON line.
WORKER = r"""
import json, statistics, time
import torch
from kvserve import LLM, SamplingParams

def timed(fn, n):
    out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return statistics.median(out)

llm = LLM(enable_prefix_caching=False, max_model_len=2048, max_num_seqs=64, num_kv_blocks=1024)
gen = lambda ps, sp: llm.generate(ps, sp, use_tqdm=False)
ids = lambda n, seed: [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]
one = SamplingParams(temperature=0.0, max_tokens=1)
long_prompt = ids(1000, 1)
gen([long_prompt], one)
res = {"prefill_1000_s": timed(lambda: gen([long_prompt], one), 3)}
short = ids(128, 2)
many = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
res["decode_b1_ms"] = 1000 * (timed(lambda: gen([short], many), 3) - timed(lambda: gen([short], one), 3)) / 128
batch = [ids(128, 3 + i) for i in range(64)]
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
t = time.perf_counter(); outs = gen(batch, sp); dt = time.perf_counter() - t
res["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
model = llm.llm_engine.model
from kvserve.batch import build_input_batch
from kvserve.core.sched_output import ScheduledRequest
step = build_input_batch([ScheduledRequest("a", long_prompt, 0, list(range(63)), samples=True)], 16)
meta = model.attn.build_metadata(step)
cache = torch.randn(model.kv_cache_shape(64, 16))[0]
h_q, d = model.num_heads, model.arch.head_dim
q = torch.randn(1000, h_q, d)
res["attn_1000_ms"] = 1000 * timed(lambda: model.attn.forward(q, cache, meta, d ** -0.5), 7)
res["attn_share"] = res["attn_1000_ms"] / 1000 * len(model.layers) / res["prefill_1000_s"]
res["attention_backend"] = model.attn.name
print("RESULT " + json.dumps(res))
"""

METRICS = ("prefill_1000_s", "throughput_tok_s", "decode_b1_ms", "attn_1000_ms", "attn_share")


def measure(tree: Path, threads: int) -> dict:
    """One measuring process in checkout ``tree``: the ``METRICS`` and the attention backend's name."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", f"import torch; torch.set_num_threads({threads})\n" + WORKER],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measuring in {tree} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="another kvserve checkout to compare against")
    ap.add_argument("--rounds", type=int, default=3, help="measuring processes per checkout, alternating")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both engines")
    args = ap.parse_args(argv)
    this = Path(__file__).resolve().parents[1]
    if not (args.baseline / "kvserve" / "__init__.py").exists():
        ap.error(f"--baseline must be a kvserve checkout (no kvserve/__init__.py in {args.baseline})")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    runs = {"baseline": [], "this": []}
    for r in range(args.rounds):
        for name, tree in (("baseline", args.baseline.resolve()), ("this", this)):
            runs[name].append(measure(tree, args.threads))
            print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(f"{k} {runs[name][-1][k]:.4g}"
                                                                       for k in METRICS), file=sys.stderr)
    print(f"| metric (median of {args.rounds}) | baseline ({runs['baseline'][0]['attention_backend']}) "
          f"| this ({runs['this'][0]['attention_backend']}) | this / baseline |")
    print("|---|---:|---:|---:|")
    for k in METRICS:
        b, t = (statistics.median(run[k] for run in runs[n]) for n in ("baseline", "this"))
        print(f"| {k} | {b:.4g} | {t:.4g} | {t / b:.3f} |")


if __name__ == "__main__":
    main()
