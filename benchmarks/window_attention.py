"""``python -m benchmarks.window_attention``: decode attention over long contexts with and without a sliding window.

One call of the paged-attention kernel (``kvserve.kernels.cpu.paged_attention``) for ``--requests`` decode rows,
each over ``--context`` keys in a float32 cache (Llama-3.2-1B's heads by default: 32 query, 8 KV heads of 64), per
window in ``--windows`` (``0``: none), per instruction-set build this CPU runs; plus the same call over a context as
long as the window with no window (what the windowed call should cost: the kernel starts each row at its window, so
nothing of it grows with the context). Each number is the fastest of ``--repeats`` calls (a shared machine is
noisy). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch


def time_call(context: int, window: int, isa: str, requests: int, heads: tuple, block_size: int,
              repeats: int) -> float:
    """Fastest of ``repeats`` calls, in ms, of ``requests`` decode rows over ``context`` keys each (``window`` 0:
    none); ``heads`` = ``(H_q, H_kv, D)``."""
    from kvserve.kernels import cpu as ck

    h_q, h_kv, d = heads
    blocks = -(-context // block_size)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, requests * blocks, block_size, h_kv, d, generator=g)
    tables = torch.arange(requests * blocks).view(requests, blocks)
    q = torch.randn(requests, h_q, d, generator=g)
    q_start, q_len = torch.arange(requests), torch.ones(requests, dtype=torch.long)
    seq_len = torch.full((requests,), context)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        t = time.perf_counter()
        if not ck.paged_attention(q, cache, tables, q_start, q_len, seq_len, d**-0.5, out, isa, window or None):
            raise RuntimeError("the kernel refused the call")
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv=None) -> list[str]:
    """Run and print the table; returns its lines.

    Raises:
        ValueError: a context, window, request count or repeat count below its minimum (the message names it).
        RuntimeError: the CPU kernels are not available here.
    """
    from kvserve.kernels import cpu as ck

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192, help="keys per request (>= 1)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 4096, 512], help="sliding windows (0: none)")
    p.add_argument("--requests", type=int, default=8, help="decode rows (>= 1)")
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], metavar=("H_Q", "H_KV", "D"))
    p.add_argument("--repeats", type=int, default=20, help="calls timed per cell (>= 1)")
    a = p.parse_args(argv)
    for name, value, low in (("context", a.context, 1), ("requests", a.requests, 1), ("repeats", a.repeats, 1),
                             ("windows", min(a.windows), 0)):
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if ck.load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {ck.unavailable_reason()}")
    isas = ck.attention_isas()
    lines = ["| window | " + " | ".join(f"{isa} ms" for isa in isas) + f" | {', '.join(isas)}: context = window, "
             "no window (ms) |", "|---|" + "---|" * (len(isas) + 1)]
    for w in a.windows:
        cells = [time_call(a.context, w, isa, a.requests, tuple(a.heads), 16, a.repeats) for isa in isas]
        same = [time_call(min(w, a.context), 0, isa, a.requests, tuple(a.heads), 16, a.repeats) for isa in isas] \
            if w else []
        lines.append(f"| {w or 'none'} | " + " | ".join(f"{c:.2f}" for c in cells) + " | "
                     + (", ".join(f"{c:.2f}" for c in same) or "-") + " |")
    print(f"{a.requests} decode rows x {a.context} keys, heads {a.heads[0]}/{a.heads[1]} x {a.heads[2]}, float32 "
          f"cache, {torch.get_num_threads()} threads")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
