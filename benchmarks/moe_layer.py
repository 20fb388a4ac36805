"""``python -m benchmarks.moe_layer``: one mixture-of-experts layer of OLMoE-1B-7B's shape (64 experts of 2048 x 1024,
8 per token; Q4_K gate/up and Q6_K down as in the Q4_K_M mix, random blocks from ``benchmarks.model_sizes``) on the
grouped expert kernel (``kvserve.layers.grouped_experts``) and on one call per chosen expert and projection (the
path before it), alternating in one process, and whether the two give the same bits. Results: docs/performance.md
("Mixture of experts: the grouped expert kernel")."""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,128", help="comma-separated token rows per call")
    p.add_argument("--rounds", type=int, default=12, help="alternations of the two paths per row count")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T

    from benchmarks.model_sizes import random_blocks
    from kvserve.layers.linear import Linear
    from kvserve.layers.moe import MoE, ExpertMLP, RouterSpec
    from kvserve.layers.quant_linear import make_linear_method
    from kvserve.quant import QuantTensor

    torch.set_num_threads(args.num_threads)
    rng = np.random.default_rng(0)
    experts_n, hidden, inter, top_k = 64, 2048, 1024, 8

    def tensor(qtype, n, k):
        return QuantTensor("w", qtype, random_blocks(qtype, n * k // 256, rng).reshape(n, -1), (n, k))

    experts = [ExpertMLP(make_linear_method([tensor(T.Q4_K, inter, hidden), tensor(T.Q4_K, inter, hidden)]),
                         make_linear_method(tensor(T.Q6_K, hidden, inter))) for _ in range(experts_n)]
    moe = MoE(Linear(torch.randn(experts_n, hidden) * 0.3), RouterSpec(experts_n, top_k), experts)
    grouped = moe.grouped
    if grouped is None:
        raise SystemExit("the grouped expert kernel does not run here (no quantized kernel path)")
    print(f"experts on {experts[0].gate_up.path} / {experts[0].down.path}, {args.num_threads} threads")
    print("| rows | grouped ms (median) | per-expert ms (median) | per-expert / grouped | same bits |")
    print("|---:|---:|---:|---:|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        times = {"grouped": [], "per-expert": []}
        reps = max(1, 40 // rows)
        for _ in range(args.rounds):
            for key, kernel in (("grouped", grouped), ("per-expert", None)):
                moe.grouped = kernel
                t = time.perf_counter()
                for _ in range(reps):
                    moe(x)
                times[key].append((time.perf_counter() - t) / reps * 1e3)
        moe.grouped = grouped
        new = moe(x)
        moe.grouped = None
        old = moe(x)
        moe.grouped = grouped
        g, e = float(np.median(times["grouped"])), float(np.median(times["per-expert"]))
        print(f"| {rows} | {g:.2f} | {e:.2f} | {e / g:.2f}x | {torch.equal(new, old)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
