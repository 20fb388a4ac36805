"""``python -m benchmarks.q4k_layout``: GGUF Q4_K in its compact packed layout (``FMT_Q4K``, 4.625 bits a weight)
against the wide one it replaced (``FMT_Q4F``: float32 ``d * sc``, ``-(dmin * mn)`` per 32 inputs, 6 bits), the
same values, side by side in one run; ``--pair mx4``: MXFP4 in its compact layout (``FMT_MX4``, 4.25 bits, expanded
to Q8 blocks per call) against the same values in Q8 blocks (``FMT_Q8``, 8.5 bits).

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


#: ``--pair`` -> the two layouts' names (compact, wide).
PAIRS = {"q4k": ("Q4K", "Q4F"), "mx4": ("MX4", "Q8")}


def weights(n: int, k: int, seed: int = 0, pair: str = "q4k") -> tuple:
    """Random Q4_K parts of ``[n, k]`` packed both ways: ``(FMT_Q4K, FMT_Q4F)`` ``PackedWeight``s (``pair="mx4"``:
    random MXFP4 codes and exponents as ``(FMT_MX4, FMT_Q8)``)."""
    from kvserve.quant import formats
    from kvserve.quant import pack as P

    rng = np.random.default_rng(seed)
    if pair == "mx4":
        codes, e = rng.integers(0, 16, (n, k), dtype=np.uint8), rng.integers(112, 124, (n, k // 32), dtype=np.uint8)
        d = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float16)
        return P.pack_mx4(codes, e), P.pack_q8(P.MX4_KVALUES[codes], d)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scmn = rng.integers(0, 64, (n, k // 32, 2), dtype=np.uint8)
    ddmin = (rng.random((n, k // 256, 2)) * 0.01 + 1e-4).astype(np.float16)
    return P.pack_q4k(q, scmn, ddmin), P.pack_q4(q, *formats.q4_k_values(scmn, ddmin))


def run(n: int, k: int, rows: list, copies: int, rounds: int, isas: Optional[list] = None, pair: str = "q4k") -> list:
    """Median ms per call of each layout: ``[{"isa", "rows", "q4k_ms", "q4f_ms", "q4k_MB", "q4f_MB"}]`` (the
    compact layout as ``q4k``, the wide as ``q4f``, whatever the ``pair``)."""
    from kvserve.kernels import qgemm as Q
    from kvserve.quant import pack as P

    q4k, q4f = weights(n, k, pair=pair)
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
    p.add_argument("--pair", default="q4k", choices=tuple(PAIRS), help="the layouts compared (see above)")
    a = p.parse_args(argv)
    n, k = (int(v) for v in a.shape.lower().split("x"))
    if k % (256 if a.pair == "q4k" else 32):
        p.error("--shape: in features must be a multiple of 256 (Q4_K's super-block; 32 for --pair mx4)")
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(n, k, [int(r) for r in a.rows.split(",")], a.copies, a.rounds, a.isa.split(",") if a.isa else None,
              a.pair)
    c, w = PAIRS[a.pair]
    print(f"{n}x{k}, {torch.get_num_threads()} threads, median ms ({c} {res[0]['q4k_MB']:.1f} MB, "
          f"{w} {res[0]['q4f_MB']:.1f} MB)\n\n| path | rows | {c} ms | {w} ms | {w} / {c} |\n|---|---:|---:|---:|---:|")
    for r in res:
        print(f"| {r['isa']} | {r['rows']} | {r['q4k_ms']:.3f} | {r['q4f_ms']:.3f} | {r['q4f_ms'] / r['q4k_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
