"""``python -m benchmarks.load_memory --model FILE.gguf``: peak RSS and time of loading a GGUF model, first run
(packing the weights into the ``weight_cache`` entry) and warm (the entry memory-mapped).

Each measurement is a fresh process (``--child``): ``load_model(keep_quantized=True, weights_only=True)`` (no
tokenizer) and ``registry.build_model`` with the default backends, then one forward of a 4-token prompt (every
weight read once). It prints the process's peak RSS (``VmHWM``), its resident set after the forward split into
anonymous memory and mapped files (``memory_report.rss_breakdown``: ``weights`` are the ``.kvpack`` / ``.gguf``
pages), and the wall time of load + build. The cache folder is ``--cache-dir`` (``KVSERVE_CACHE_DIR``); the runs
are: ``prime`` (compiles the kernels, parses the GGUF metadata, packs: its time is not a start-up time), ``first``
(the packed entry deleted first: a first run's packing with everything else cached) and ``warm``.

A random-weight file of a real shape: ``python -m benchmarks.model_sizes --sizes 3b --formats q8_0 --write-only``.
Results: docs/performance.md ("Files larger than half the RAM").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def child(model: str) -> dict:
    """One load in this process -> ``{"seconds", "peak_mib", "rss_mib", "anon_mib", "weights_mib"}``."""
    import torch

    from benchmarks.accuracy import all_logits
    from kvserve.entrypoints.memory_report import _status_kib, rss_breakdown
    from kvserve.model.backends import select_backends
    from kvserve.model.loader import load_model
    from kvserve.model.registry import build_model

    t0 = time.perf_counter()
    loaded = load_model(model, "float32", keep_quantized=True, weights_only=True)
    model_ = build_model(loaded, select_backends("cpu", torch.float32, "auto"))
    seconds = time.perf_counter() - t0
    all_logits(model_, [1, 2, 3, 4])
    b = rss_breakdown()
    mib = 1 / 2**20
    return {"seconds": round(seconds, 2), "peak_mib": round(_status_kib("VmHWM") / 1024, 1),
            "rss_mib": round(b["rss"] * mib, 1), "anon_mib": round(b["anonymous"] * mib, 1),
            "weights_mib": round(b["by_kind"]["weights"]["rss"] * mib, 1)}


def run(model: str, cache_dir: Path, label: str) -> dict:
    env = dict(os.environ, KVSERVE_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--child", model], env=env, check=True,
                         capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{label:6s} load+build {r['seconds']:7.2f} s  peak RSS {r['peak_mib']:8.1f} MiB  after a forward: "
          f"RSS {r['rss_mib']:8.1f} MiB (anonymous {r['anon_mib']:8.1f}, weights' files {r['weights_mib']:8.1f})",
          flush=True)
    return r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=False)
    p.add_argument("--cache-dir", default="/tmp/kvserve-load-memory")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return
    cache = Path(args.cache_dir)
    run(args.model, cache, "prime")
    shutil.rmtree(cache / "weights", ignore_errors=True)
    run(args.model, cache, "first")
    run(args.model, cache, "warm")


if __name__ == "__main__":
    main()
