"""``python -m benchmarks.q4k_layout``: GGUF Q4_K in its compact packed layout (``FMT_Q4K``, 4.625 bits a weight)
against the wide one it replaced (``FMT_Q4F``: float32 ``d * sc``, ``-(dmin * mn)`` per 32 inputs, 6 bits), the
same values, side by side in one run.

One ``--shape`` matmul (default Llama-3.2-1B's ffn gate/up, 8192 x 2048) at each ``--rows`` count on each
instruction-set path this CPU has; ``--copies`` copies of each weight are cycled so small row counts read the
weights from memory, as a decode step does; the two layouts are interleaved call by call and the median is kept (a
shared machine is noisy: read the ratio). Outputs are checked equal (the layouts give the same bits). Results:
docs/quantization.md ("Q4_K").
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np
import torch


def weights(n: int, k: int, seed: int = 0) -> tuple:
    """Random Q4_K parts of ``[n, k]`` packed both ways: ``(FMT_Q4K, FMT_Q4F)`` ``PackedWeight``s."""
    from kvserve.quant import formats
    from kvserve.quant import pack as P

    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scmn = rng.integers(0, 64, (n, k // 32, 2), dtype=np.uint8)
    ddmin = (rng.random((n, k // 256, 2)) * 0.01 + 1e-4).astype(np.float16)
    return P.pack_q4k(q, scmn, ddmin), P.pack_q4(q, *formats.q4_k_values(scmn, ddmin))


def run(n: int, k: int, rows: list, copies: int, rounds: int, isas: Optional[list] = None) -> list:
    """Median ms per call of each layout: ``[{"isa", "rows", "q4k_ms", "q4f_ms", "q4k_MB", "q4f_MB"}]``."""
    from kvserve.kernels import qgemm as Q
    from kvserve.quant import pack as P

    q4k, q4f = weights(n, k)
    sets = {name: [P.PackedWeight(w.fmt, w.data.clone(), n, k) for _ in range(copies)]
            for name, w in (("q4k", q4k), ("q4f", q4f))}
    out = []
    for isa in isas or [i for i in Q.ISAS if Q.cpu_supports(i)]:
        act = Q.DEFAULT_ACTIVATIONS[isa]
        for m in rows:
            x = torch.randn(m, k)
            assert torch.equal(Q.qgemm(x, q4k, isa, act), Q.qgemm(x, q4f, isa, act))
            times: dict = {"q4k": [], "q4f": []}
            for _ in range(rounds):
                for i in range(copies if m <= 8 else 1):
                    for name, ws in sets.items():
                        t = time.perf_counter()
                        Q.qgemm(x, ws[i], isa, act)
                        times[name].append(time.perf_counter() - t)
            out.append({"isa": isa, "rows": m, **{f"{nm}_ms": 1e3 * float(np.median(v)) for nm, v in times.items()},
                        "q4k_MB": q4k.nbytes() / 1e6, "q4f_MB": q4f.nbytes() / 1e6})
    return out


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.q4k_layout", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="8192x2048", help="out x in features (in a multiple of 256)")
    p.add_argument("--rows", default="1,32,64,512", help="comma-separated row counts")
    p.add_argument("--copies", type=int, default=12, help="weight copies cycled at <= 8 rows (reads from memory)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (and OpenMP for the kernels)")
    p.add_argument("--isa", default=None, help="comma-separated paths (default: every one this CPU has)")
    a = p.parse_args(argv)
    n, k = (int(v) for v in a.shape.lower().split("x"))
    if k % 256:
        p.error("--shape: in features must be a multiple of 256 (Q4_K's super-block)")
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(n, k, [int(r) for r in a.rows.split(",")], a.copies, a.rounds, a.isa.split(",") if a.isa else None)
    print(f"{n}x{k}, {torch.get_num_threads()} threads, median ms (Q4K {res[0]['q4k_MB']:.1f} MB, "
          f"Q4F {res[0]['q4f_MB']:.1f} MB)\n\n| path | rows | Q4K ms | Q4F ms | Q4F / Q4K |\n|---|---:|---:|---:|---:|")
    for r in res:
        print(f"| {r['isa']} | {r['rows']} | {r['q4k_ms']:.3f} | {r['q4f_ms']:.3f} | {r['q4f_ms'] / r['q4k_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
