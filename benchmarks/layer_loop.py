"""The decoder's layer loop three ways, side by side on one engine: ``python -m benchmarks.layer_loop``.

Batch-1 decode steps (128-token prompt, 64 tokens, EOS ignored) with the fused C loop
(``kvserve.model.fused_layers``), with the Python loop, and with ``torch.compile`` of the Python loop, interleaved
over ``--rounds`` rounds so that drift of a shared machine falls on all three. Prints the median ms per step.
Results: docs/performance.md, "Decode step breakdown".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, SamplingParams


def decode_ms(engine, tag: str, steps: int = 64, reps: int = 3) -> float:
    """Median ms per decode step of ``reps`` batch-1 requests (their prefill not counted)."""
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out = []
    for r in range(reps):
        engine.add_request(list(range(1000, 1128)), sp, request_id=f"{tag}-{r}-{time.monotonic_ns()}")
        while engine.scheduler.waiting or any(q.num_computed_tokens < q.num_prompt_tokens
                                              for q in engine.scheduler.running):
            engine.step()
        t, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        out.append((time.perf_counter() - t) / n * 1000)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    engine = LLM(num_kv_blocks=256, max_num_seqs=4, num_threads=args.num_threads).llm_engine
    model = engine.model
    fused, python_loop = model.fused_layers, model._layer_loop
    if fused is None:
        raise SystemExit("this engine runs no fused loop (kernels unavailable or fused_layers off)")
    variants = {"fused C loop": (fused, python_loop), "Python loop": (None, python_loop),
                "torch.compile(Python loop)": (None, torch.compile(python_loop, dynamic=True))}
    results = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (loop, layer_loop) in variants.items():
            model.fused_layers, model._layer_loop = loop, layer_loop
            results[name].append(decode_ms(engine, name))
    model.fused_layers, model._layer_loop = fused, python_loop
    for name, values in results.items():
        print(f"{name:<28} median {statistics.median(values):6.2f} ms/step  rounds {[round(v, 2) for v in values]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
