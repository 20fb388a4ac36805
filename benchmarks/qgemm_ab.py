"""``python -m benchmarks.qgemm_ab --baseline REV``: this checkout's quantized matmul against another commit's, paired
call by call in one process, outputs compared bit for bit.

The baseline's ``qgemm.c`` / ``decoder.c`` and headers are read from git (``git show REV:kvserve/kernels/csrc/...``)
and compiled with the flags ``kvserve.kernels.qgemm`` uses (``$CC``, default ``cc``) into a temporary folder. Random
weights of the Llama-3.2-1B projections' shapes (``--shapes``; out x in) in each ``--kinds`` layout, random rows
(``--rows``), one ``--isa`` path and ``--activations``. Each round calls both libraries in turn (the order
alternating), each call after a 32 MiB write that evicts the last call's data; printed per case (a markdown row):
each side's median ms, the median of the paired this / baseline ratios (below 1: this checkout is faster), which
holds when the host's speed drifts, and whether every output had the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.kernels import qgemm as kernels
from kvserve.quant import pack as P

CSRC = "kvserve/kernels/csrc"
#: out x in of Llama-3.2-1B's projections: q/k/v fused, o, gate/up fused, down.
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def build_baseline(rev: str, out_dir: Path) -> Path:
    """The library of commit ``rev`` (its sources from git) compiled into ``out_dir``.

    Raises:
        subprocess.CalledProcessError: ``rev`` or a file is unknown to git, or the compiler failed.
    """
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    for name in (*kernels._SOURCES, *kernels._HEADERS):
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=root, capture_output=True, check=True)
        (out_dir / name).write_bytes(text.stdout)
    lib = out_dir / "libbaseline.so"
    sources = [str(out_dir / s) for s in kernels._SOURCES]
    subprocess.run([os.environ.get("CC", "cc"), *kernels._FLAGS, *sources, "-o", str(lib), "-lm"], check=True)
    return lib


def random_weight(kind: str, n: int, k: int, rng: np.random.Generator) -> P.PackedWeight:
    """A random ``q8`` (Q8_0), ``q4`` (Q4_0/Q4_1's layout) or ``q4k`` (Q4_K) weight ``[n, k]``."""
    nb = k // 32
    if kind == "q8":
        return P.pack_q8(rng.integers(-128, 128, (n, k)).astype(np.int8),
                         (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float16))
    if kind == "q4":
        return P.pack_q4(rng.integers(0, 16, (n, k), dtype=np.uint8),
                         (rng.random((n, nb)) * 0.1 + 0.01).astype(np.float16),
                         (-rng.random((n, nb)) * 0.5).astype(np.float16))
    if kind == "q4k":
        return P.pack_q4k(rng.integers(0, 16, (n, k), dtype=np.uint8), rng.integers(0, 64, (n, nb, 2), dtype=np.uint8),
                          (rng.random((n, k // 256, 2)) * 0.01 + 0.001).astype(np.float16))
    raise ValueError(f"--kinds: {kind!r} is not one of q8, q4, q4k")


def compare(libs: list, w: P.PackedWeight, rows: int, isa: int, act: int, rounds: int) -> tuple[list, list]:
    """``rounds`` paired calls of each library on the same weight and rows -> (per-library call times in seconds,
    outputs). Raises ``RuntimeError`` if a library refuses the call."""
    x = torch.randn(rows, w.in_features)
    n_pad = w.data.shape[0] * P.G
    ys = [torch.empty(rows, n_pad) for _ in libs]
    times: list = [[] for _ in libs]
    evict = torch.zeros(8 * 2**20)
    for r in range(rounds):
        for i in (range(len(libs)) if r % 2 == 0 else reversed(range(len(libs)))):
            evict.add_(1.0)
            t = time.perf_counter()
            rc = libs[i].kvserve_qgemm(w.fmt, isa, act, x.data_ptr(), rows, w.in_features, w.data.data_ptr(), n_pad,
                                       None if w.oscale is None else w.oscale.data_ptr(), ys[i].data_ptr(), n_pad)
            times[i].append(time.perf_counter() - t)
            if rc != 0:
                raise RuntimeError(f"kvserve_qgemm returned {rc}")
    return times, ys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qgemm_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the git commit (or branch) to compare against")
    p.add_argument("--kinds", default="q8,q4k", help="comma-separated: q8, q4, q4k")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,64,512", help="comma-separated row counts")
    p.add_argument("--isa", default="amx_int8", choices=list(kernels.ISAS))
    p.add_argument("--activations", default="bf16", choices=list(kernels.ACTIVATIONS))
    p.add_argument("--rounds", type=int, default=40, help="paired calls per case")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: {unknown} not among {list(SHAPES)}")
    this = kernels.load()
    if this is None or not kernels.cpu_supports(args.isa):
        p.error(f"--isa {args.isa}: not available here ({kernels.unavailable_reason() or 'the CPU lacks it'})")
    if not kernels.activations_supported(args.isa, args.activations):
        p.error(f"--activations {args.activations}: the {args.isa} path on this CPU lacks it")
    with tempfile.TemporaryDirectory() as tmp:
        base = ctypes.CDLL(str(build_baseline(args.baseline, Path(tmp))))
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        base.kvserve_qgemm.argtypes = [cint, cint, cint, ptr, i64, i64, ptr, i64, ptr, ptr, i64]
        base.kvserve_qgemm.restype = cint
        rng = np.random.default_rng(0)
        base_name = args.baseline
        print(f"| kind | shape | rows | this ms | {base_name} ms | this / {base_name} (paired median) | same bits |")
        print("|---|---|---:|---:|---:|---:|---|")
        for kind in args.kinds.split(","):
            for shape in args.shapes.split(","):
                n, k = SHAPES[shape]
                w = random_weight(kind, n, k, rng)
                for rows in map(int, args.rows.split(",")):
                    (t_new, t_old), (y_new, y_old) = compare(
                        [this, base], w, rows, kernels.ISAS[args.isa], kernels.ACTIVATIONS[args.activations],
                        args.rounds)
                    ratio = float(np.median(np.array(t_new) / np.array(t_old)))
                    print(f"| {kind} | {shape} {n}x{k} | {rows} | {np.median(t_new) * 1e3:.3f} | "
                          f"{np.median(t_old) * 1e3:.3f} | {ratio:.3f} | {torch.equal(y_new, y_old)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
