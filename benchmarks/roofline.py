"""``python -m benchmarks.roofline``: this machine's limits, and the engine's decode step and prefill against them.

Measured here, in one run (never taken from a table: the machines differ):

- read bandwidth (GB/s): ``torch.sum`` over a buffer far larger than the last-level cache, best of N
  (``quant_kernels.read_bandwidth_gbs``);
- fp32 peak (GFLOP/s): a square ``torch.mm``, best of N;
- int8 peak (GOP/s): kvserve's own quantized matmul (``kvserve.kernels.qgemm.qgemm``, the path and the
  activation quantization the engine uses: with the 15-bit pair each multiply-add costs two int8 ones, so its peak
  is about half) on a compute-bound shape (many rows, a weight that stays in cache), best of N.

Then, per ``--quantization``, the decode step time at each batch size (``throughput.step_costs``: median of real
engine steps, each request at ``--context`` tokens) against its roofline bound (``bounds``): the time to read the
weights and the batch's K/V once (bandwidth bound) and the time to do its multiply-adds at the peak of the
weights' arithmetic (compute bound: int8 for quantized weights, fp32 otherwise). The issue's targets, as ratios:
batch-1 step <= 1.3x its bandwidth bound; batch-64 step <= 2x its compute bound. Also prefill tokens/s of one
``--prefill-tokens``-token prompt (best of 3, prefix caching off) against its compute bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)


#: The issue's targets: step / bandwidth bound at batch 1, step / compute bound at the largest batch.
TARGET_BATCH1_BW = 1.3
TARGET_BATCH64_COMPUTE = 2.0


@dataclass
class ModelCost:
    """What one decode token of a built model reads and computes.

    Attributes:
        weight_bytes: bytes of every projection's weights and scales (read once per step, whatever the batch).
        macs_per_token: multiply-adds of the projections per token (``sum(out * in)``).
        kv_bytes_per_token: K and V bytes of one cached token, all layers (a decode row reads its context's).
        int8: whether the projections use kvserve's int8 dot-product kernels (their peak applies) or float32.
    """

    weight_bytes: int
    macs_per_token: int
    kv_bytes_per_token: int
    int8: bool


@dataclass
class Bound:
    """Roofline bounds of one step, milliseconds: ``bandwidth_ms`` (bytes / bandwidth), ``compute_ms``
    (2 * multiply-adds / peak), ``bound_ms`` (the larger: what the step cannot beat)."""

    bandwidth_ms: float
    compute_ms: float

    @property
    def bound_ms(self) -> float:
        return max(self.bandwidth_ms, self.compute_ms)


def bounds(cost: ModelCost, batch: int, context: int, bandwidth_gbs: float, peak_gops: float) -> Bound:
    """The roofline of a decode step of ``batch`` rows, each attending to ``context`` cached tokens.

    Bytes = ``weight_bytes + batch * context * kv_bytes_per_token``; operations = ``2 * batch * macs_per_token``
    (attention's multiply-adds are left out: at short contexts they are ~1% of the projections').

    Raises:
        ValueError: a batch below 1, a negative context, or a bandwidth or peak that is not positive.
    """
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch}, context={context}")
    if bandwidth_gbs <= 0 or peak_gops <= 0:
        raise ValueError(f"bandwidth_gbs and peak_gops must be > 0, got {bandwidth_gbs}, {peak_gops}")
    nbytes = cost.weight_bytes + batch * context * cost.kv_bytes_per_token
    return Bound(bandwidth_ms=nbytes / (bandwidth_gbs * 1e9) * 1e3,
                 compute_ms=2 * batch * cost.macs_per_token / (peak_gops * 1e9) * 1e3)


def prefill_bound_tokens_per_s(cost: ModelCost, peak_gops: float) -> float:
    """Prefill's compute bound in tokens/s: ``peak / (2 * macs_per_token)`` (a long prompt reads the weights once
    and is compute-bound)."""
    return peak_gops * 1e9 / (2 * cost.macs_per_token)


def model_cost(model, kv_cache_dtype: Optional[torch.dtype] = None) -> ModelCost:
    """``ModelCost`` of a built ``CausalLM`` (``kvserve.model.decoder.DecoderModel``): its projections and LM head
    (of a mixture of experts: the router and ``top_k`` experts, the bytes one token reads), and the KV bytes per
    token in ``kv_cache_dtype`` (default: the model's dtype)."""
    from kvserve.layers.quant_linear import QuantLinear

    linears = [model.lm_head] + [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")
                                 if layer[k] is not None]
    for layer in model.layers:  # a mixture of experts: what a token reads -- the router, top_k experts, the shared
        moe = layer.get("moe")
        if moe is not None:
            per_token = [moe.router] + [lin for e in moe.experts[: moe.spec.top_k] for lin in (e.gate_up, e.down)]
            linears += per_token + ([moe.shared_expert.gate_up, moe.shared_expert.down] if moe.shared_expert else [])
    parts = [p for lin in linears for p in getattr(lin, "parts", [lin])]
    nbytes = sum(p.weight_bytes() if hasattr(p, "weight_bytes") else p.numel() * model.dtype.itemsize for p in parts)
    return ModelCost(weight_bytes=int(nbytes), macs_per_token=int(sum(p.numel() for p in parts)),
                     kv_bytes_per_token=model.bytes_per_block(1, kv_cache_dtype),
                     int8=all(isinstance(p, QuantLinear) for p in parts))


# ------------------------------------------------------------------------------------------------ measurements


def cpu_info() -> dict:
    """CPU model, logical CPUs and the SIMD flags that matter here, from ``/proc/cpuinfo`` (empty on others)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": "unknown", "cpus": torch.get_num_threads(), "flags": []}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 "unknown")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")
    return {"model": model, "cpus": text.count("processor\t:"), "flags": [f for f in wanted if f in flags]}


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def fp32_peak_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of ``torch.mm`` on two ``n x n`` float32 matrices (``2 n^3`` flops)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: torch.mm(a, b), repeats) / 1e9


def int8_peak_gops(m: int = 256, n: int = 1024, k: int = 1024, repeats: int = 5) -> Optional[float]:
    """Best-of-``repeats`` GOP/s (``2 m n k`` operations) of kvserve's quantized matmul on an ``m x k`` activation
    and an ``n x k`` Q8 weight (1 MiB: stays in cache; compute-bound), with the process's activation quantization
    (``kernels.default_path()``); ``None`` without the kernels."""
    from kvserve.kernels import qgemm as kernels
    from kvserve.quant import pack as P

    if kernels.isa() is None:
        return None
    rng = np.random.default_rng(0)
    w = P.pack_q8(rng.integers(-127, 128, (n, k), dtype=np.int8), np.full((n, k // P.QK), 0.01, np.float16))
    x = torch.randn(m, k)
    act = kernels.default_path().activations
    return 2 * m * n * k / _best(lambda: kernels.qgemm(x, w, activations=act), repeats) / 1e9


def _activations() -> str:
    from kvserve.kernels import qgemm as kernels

    return kernels.default_path().activations


def prefill_tokens_per_s(engine_args: dict, n_tokens: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` tokens/s of one ``n_tokens``-token prompt's prefill (plus its one sampled token), prefix
    caching off, on a fresh engine."""
    from kvserve import LLM, SamplingParams

    llm = LLM(**{**engine_args, "enable_prefix_caching": False})
    prompt = [1000 + i % 20000 for i in range(n_tokens)]
    sp = SamplingParams(temperature=0, max_tokens=1)
    return n_tokens / _best(lambda: llm.generate([prompt], sp), repeats)


# ------------------------------------------------------------------------------------------------------- report


def format_rows(rows: list) -> str:
    """Markdown table of ``[{"batch", "step_ms", "bandwidth_ms", "compute_ms", ...}]``."""
    out = ["| batch | step (ms) | bandwidth bound (ms) | compute bound (ms) | step / bound | step / bw | "
           "step / compute |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['step_ms']:.1f} | {r['bandwidth_ms']:.2f} | {r['compute_ms']:.2f} | "
                   f"{r['step_ms'] / max(r['bandwidth_ms'], r['compute_ms']):.2f} | "
                   f"{r['step_ms'] / r['bandwidth_ms']:.2f} | {r['step_ms'] / r['compute_ms']:.2f} |")
    return "\n".join(out)


def bandwidth_drift(before_gbs: float, after_gbs: float, batch1_ratio: Optional[float]) -> str:
    """One report line: the read bandwidth measured again after the steps and, given the batch-1 step / bandwidth
    bound against the first reading, the same ratio against this one (the bound is bytes / bandwidth, so the ratio
    scales with the bandwidth). The bounds above use the first reading; on a shared host the reading can move by
    tens of percent within minutes, and the ratio moves with it.

    Raises:
        ValueError: a bandwidth that is not positive.
    """
    if before_gbs <= 0 or after_gbs <= 0:
        raise ValueError(f"bandwidths must be > 0 GB/s, got {before_gbs}, {after_gbs}")
    line = (f"read bandwidth after the steps {after_gbs:.1f} GB/s (before: {before_gbs:.1f}, "
            f"{100 * (after_gbs / before_gbs - 1):+.0f}%)")
    if batch1_ratio is not None:
        line += (f"; batch-1 step / bandwidth bound {batch1_ratio:.2f}x against the first reading, "
                 f"{batch1_ratio * after_gbs / before_gbs:.2f}x against this one")
    return line


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", nargs="+", default=["auto", "fp32"], choices=["auto", "fp32", "int8"],
                   help="the weights' paths to measure, in one run (default: auto fp32)")
    p.add_argument("--batch-sizes", default="1,8,32,64", help="decode batch sizes to report (comma-separated)")
    p.add_argument("--context", type=int, default=128, help="tokens of context per request in the decode steps")
    p.add_argument("--prefill-tokens", type=int, default=1000, help="prompt length of the prefill measurement "
                                                                    "(0: skip)")
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """Measure the machine, then each quantization's steps and prefill; print tables (and JSON)."""
    from kvserve import LLM
    from benchmarks.quant_kernels import read_bandwidth_gbs
    from benchmarks.step_profile import step_costs

    batches = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    info = cpu_info()
    bw, fp32, int8 = read_bandwidth_gbs(), fp32_peak_gflops(), int8_peak_gops()
    print(f"CPU: {info['model']} ({info['cpus']} logical CPUs, torch threads {torch.get_num_threads()}; "
          f"{' '.join(info['flags'])})")
    print(f"read bandwidth {bw:.1f} GB/s; fp32 peak {fp32:.1f} GFLOP/s (torch.mm); int8 peak "
          + (f"{int8:.1f} GOP/s (kvserve qgemm, {_activations()} activations)" if int8
             else "n/a (quantized kernels unavailable)"))
    report = {"cpu": info, "bandwidth_gbs": bw, "fp32_gflops": fp32, "int8_gops": int8, "quantizations": {}}
    for q in args.quantization:
        eargs = {**engine_args, "quantization": q}
        logger.info("quantization %s: a one-block engine to read the model's bytes and operations", q)
        probe = LLM(**{**eargs, "num_kv_blocks": 1}).llm_engine
        cost = model_cost(probe.model, probe.kv_cache_dtype)
        peak = int8 if cost.int8 and int8 else fp32
        steps = {c["batch"]: c["step_ms"] for c in step_costs(eargs, max(batches), args.context)}
        rows = []
        for b in batches:
            step = steps.get(b)
            if step is None:  # step_costs measures powers of two
                continue
            rows.append({"batch": b, "step_ms": step, **asdict(bounds(cost, b, args.context, bw, peak))})
        res = {"cost": asdict(cost), "peak_gops": peak, "steps": rows}
        print(f"\nquantization {q}: weights {cost.weight_bytes / 1e6:.1f} MB, {cost.macs_per_token / 1e6:.1f} M "
              f"multiply-adds/token, KV {cost.kv_bytes_per_token / 1e3:.1f} kB/token; peak used "
              f"{peak:.1f} G{'OP' if cost.int8 and int8 else 'FLOP'}/s")
        print(format_rows(rows))
        if rows and rows[0]["batch"] == 1:
            r = rows[0]["step_ms"] / rows[0]["bandwidth_ms"]
            print(f"batch 1: {r:.2f}x its bandwidth bound (target <= {TARGET_BATCH1_BW}x: "
                  f"{'met' if r <= TARGET_BATCH1_BW else 'missed'})")
        if rows and rows[-1]["batch"] == 64:
            r = rows[-1]["step_ms"] / rows[-1]["compute_ms"]
            print(f"batch 64: {r:.2f}x its compute bound (target <= {TARGET_BATCH64_COMPUTE}x: "
                  f"{'met' if r <= TARGET_BATCH64_COMPUTE else 'missed'})")
        if args.prefill_tokens > 0:
            tps = prefill_tokens_per_s(eargs, args.prefill_tokens)
            bound = prefill_bound_tokens_per_s(cost, peak)
            res["prefill"] = {"tokens": args.prefill_tokens, "tokens_per_s": tps, "bound_tokens_per_s": bound}
            print(f"prefill of {args.prefill_tokens} tokens: {tps:.0f} tokens/s, {tps / bound:.2f} of its compute "
                  f"bound ({bound:.0f} tokens/s)")
        report["quantizations"][q] = res
    bw_after = read_bandwidth_gbs()
    report["bandwidth_gbs_after"] = bw_after
    for q, res in report["quantizations"].items():
        first = res["steps"][0] if res["steps"] and res["steps"][0]["batch"] == 1 else None
        ratio = None if first is None else first["step_ms"] / first["bandwidth_ms"]
        print(f"quantization {q}: " + bandwidth_drift(bw, bw_after, ratio))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from benchmarks import engine_main

    raise SystemExit(engine_main("roofline", __doc__, add_args, run, skip=("quantization",), pass_engine_kwargs=True))
