"""``python -m benchmarks.moe_layer``: one mixture-of-experts layer on the grouped expert kernel
(``kvserve.layers.grouped_experts``) and on one call per chosen expert and projection (the per-expert path),
alternating in one process, and whether the two give the same bits. ``--shape olmoe`` (default): OLMoE-1B-7B's
layer, 64 experts of 2048 x 1024, 8 per token, Q4_K gate/up and Q6_K down as in the Q4_K_M mix; ``--shape gpt-oss``:
gpt-oss-20b's layer, 32 experts of 2880 x 2880, 4 per token, MXFP4 experts with gate/up and down biases, the clamped
SwiGLU and the biased top-k-then-softmax router. Random blocks from ``benchmarks.model_sizes``. Where the grouped
kernel declines the layer (an older kvserve), only the per-expert path is timed. Results: docs/performance.md
("Mixture of experts: the grouped expert kernel")."""

from __future__ import annotations

import argparse
import time


#: Layer shapes: experts, hidden width, one expert's MLP width, experts per token, (gate/up, down) GGUF types.
SHAPES = {"olmoe": {"experts": 64, "hidden": 2048, "inter": 1024, "top_k": 8, "formats": ("Q4_K", "Q6_K")},
          "gpt-oss": {"experts": 32, "hidden": 2880, "inter": 2880, "top_k": 4, "formats": ("MXFP4", "MXFP4")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,128", help="comma-separated token rows per call")
    p.add_argument("--rounds", type=int, default=12, help="alternations of the two paths per row count")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--shape", choices=sorted(SHAPES), default="olmoe", help="the layer's shape (module docstring)")
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from benchmarks.model_sizes import random_blocks
    from kvserve.layers.linear import Linear
    from kvserve.layers.moe import MoE, ExpertMLP, RouterSpec
    from kvserve.layers.quant_linear import make_linear_method
    from kvserve.quant import QuantTensor

    torch.set_num_threads(args.num_threads)
    rng = np.random.default_rng(0)
    shape = SHAPES[args.shape]
    experts_n, hidden, inter, top_k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    gate_q, down_q = (getattr(T, q) for q in shape["formats"])
    gpt_oss = args.shape == "gpt-oss"

    def tensor(qtype, n, k):
        blocks = n * k // GGML_QUANT_SIZES[qtype][0]
        return QuantTensor("w", qtype, random_blocks(qtype, blocks, rng).reshape(n, -1), (n, k))

    def bias(n):
        return torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if gpt_oss else None

    experts = [ExpertMLP(make_linear_method([tensor(gate_q, inter, hidden), tensor(gate_q, inter, hidden)]),
                         make_linear_method(tensor(down_q, hidden, inter)), "swiglu_oai" if gpt_oss else "silu",
                         bias(2 * inter), bias(hidden)) for _ in range(experts_n)]
    spec = RouterSpec(experts_n, top_k, "topk_softmax" if gpt_oss else "softmax_topk")
    moe = MoE(Linear(torch.randn(experts_n, hidden) * 0.3), spec, experts, router_bias=bias(experts_n))
    grouped = moe.grouped
    paths = (("grouped", grouped), ("per-expert", None)) if grouped is not None else (("per-expert", None),)
    print(f"{args.shape}: experts on {experts[0].gate_up.path} / {experts[0].down.path}, {args.num_threads} "
          f"threads{'' if grouped is not None else ' (the grouped kernel declines this layer)'}")
    print("| rows | grouped ms (median) | per-expert ms (median) | per-expert / grouped | same bits |")
    print("|---:|---:|---:|---:|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        times = {"grouped": [], "per-expert": []}
        reps = max(1, 40 // rows)
        for _ in range(args.rounds):
            for key, kernel in paths:
                moe.grouped = kernel
                t = time.perf_counter()
                for _ in range(reps):
                    moe(x)
                times[key].append((time.perf_counter() - t) / reps * 1e3)
        e = float(np.median(times["per-expert"]))
        if grouped is None:
            print(f"| {rows} | - | {e:.2f} | - | - |", flush=True)
            continue
        moe.grouped = grouped
        new = moe(x)
        moe.grouped = None
        old = moe(x)
        moe.grouped = grouped
        g = float(np.median(times["grouped"]))
        print(f"| {rows} | {g:.2f} | {e:.2f} | {e / g:.2f}x | {torch.equal(new, old)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
