"""``python -m benchmarks.kquant_decode``: Q6_K on its own kernel (``q6_k``) against the path it replaced (the same
values re-quantized to int8 per 32-block, ``q8_from_Q6_K``), side by side in one run.

1. Layers: one output row (a decode step's matmul) through Q6_K weights of real shapes (random weights quantized by
   ``kvserve.quant.kquantize``), each method timed in interleaved rounds, the fastest round kept (a shared machine is
   noisy: read the ratio).
2. Model (``--model FILE``, a GGUF with Q6_K tensors, e.g. from ``benchmarks.requantize_gguf``): batch-1 greedy
   decode tok/s (``--prompt-tokens``, ``--max-tokens``, EOS ignored) with each path, each in a fresh subprocess with
   its own packed-weight cache folder, interleaved ``--repeats`` times, the best kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import torch

SHAPES = [(576, 1536), (2048, 8192), (8192, 2048)]  # SmolLM2 ffn_down; Llama-3.2-1B ffn_down, gate/up


def _layers(n: int, k: int, isa_path):
    from kvserve.layers.quant_linear import QuantLinear, make_linear_method
    from kvserve.quant import QuantTensor, formats
    from kvserve.quant import pack as P
    from kvserve.quant.kquantize import quantize_q6_k

    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.02
    t = QuantTensor("w", formats.Q6_K, quantize_q6_k(w), (n, k))
    new = make_linear_method(t, path=isa_path)
    old = QuantLinear(P.pack_q8(*P.quantize_q8_blocks(t.dequantize())), "q8_from_Q6_K", isa=isa_path.isa,
                      activations=isa_path.activations)
    return {"q6_k": new, "q8_from_Q6_K": old}


def bench_layers(repeats: int, min_s: float) -> list:
    from kvserve.kernels import qgemm

    path = qgemm.default_path()
    rows = []
    for n, k in SHAPES:
        layers = _layers(n, k, path)
        x = torch.randn(1, k)
        best = dict.fromkeys(layers, float("inf"))
        for _ in range(repeats):
            for name, layer in layers.items():
                layer(x)
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < min_s:
                    layer(x)
                    calls += 1
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
        rows.append({"shape": f"{n}x{k}", "path": layers["q6_k"].path.split("/", 1)[1],
                     **{f"{m}_us": round(v * 1e6, 1) for m, v in best.items()},
                     **{f"{m}_MB": round(layers[m].weight_bytes() / 1e6, 2) for m in layers}})
    return rows


_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
from kvserve.layers import quant_linear as QL
from kvserve.quant import formats, pack as P
if sys.argv[2] == "q8_from_Q6_K":  # the path before Q6_K had a kernel: decoded, re-quantized per 32-block
    real = QL._canonical
    def old(t, quantization):
        if t.qtype == formats.Q6_K and quantization == "auto":
            q, d = QL._chunked(t, P.quantize_q8_blocks)
            return "q8_from_Q6_K", P.FMT_Q8, q, d, None
        return real(t, quantization)
    QL._canonical = old
from kvserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], num_kv_blocks=64, max_num_seqs=1)
n_prompt, n_new = int(sys.argv[3]), int(sys.argv[4])
prompt = [list(range(1000, 1000 + n_prompt))]
sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
t0 = time.perf_counter(); llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
prefill = time.perf_counter() - t0
t0 = time.perf_counter(); out = llm.generate(prompt, sp)[0]
total = time.perf_counter() - t0
paths = sorted({p for l in llm.llm_engine.model.layers for p in [l["down"].path]})
print(json.dumps({"decode_tok_s": (n_new - 1) / max(total - prefill, 1e-9), "paths": paths,
                  "tokens": out.outputs[0].token_ids}))
"""


def bench_model(model: str, repeats: int, prompt_tokens: int, max_tokens: int, threads: int = 1) -> dict:
    best: dict = {}
    for _ in range(repeats):
        for variant in ("q6_k", "q8_from_Q6_K"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "KVSERVE_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
                out = subprocess.run([sys.executable, "-c", _CHILD, model, variant, str(prompt_tokens), str(max_tokens)],
                                     env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if variant not in best or r["decode_tok_s"] > best[variant]["decode_tok_s"]:
                best[variant] = r
    same = best["q6_k"]["tokens"] == best["q8_from_Q6_K"]["tokens"]
    return {v: {"decode_tok_s": round(r["decode_tok_s"], 1), "paths": r["paths"]} for v, r in best.items()} | {
        "same_tokens": same}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF with Q6_K tensors: also time batch-1 decode of the model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=0.2, help="per layer method per round")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (and OpenMP for the kernels), both "
                   "parts; 1 by default: on a shared machine OpenMP barriers make multi-threaded timings noise")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = {"layers": bench_layers(a.repeats, a.min_seconds)}
    print("| Q6_K weight (out x in) | path | q6_k us | q8_from_Q6_K us | q6_k MB | q8_from MB |")
    print("|---|---|---|---|---|---|")
    for r in res["layers"]:
        print(f"| {r['shape']} | {r['path']} | {r['q6_k_us']} | {r['q8_from_Q6_K_us']} | {r['q6_k_MB']} | "
              f"{r['q8_from_Q6_K_MB']} |")
    if a.model:
        res["model"] = bench_model(a.model, a.repeats, a.prompt_tokens, a.max_tokens, a.threads)
        print(json.dumps(res["model"]))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
