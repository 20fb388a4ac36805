"""``python -m benchmarks.kv_cache_dtype``: the KV cache's element types side by side (docs/kv_cache_dtype.md).

Measurements (``--measure``, comma-separated; default all):

- ``accuracy``: each cache type against the float32 cache on one model (``--model``, default the default model;
  ``--random-1b`` adds a random-weight Llama-3.2-1B-shaped Q4_0 GGUF written by ``benchmarks.model_sizes``).
  Teacher forcing over the first ``--total-tokens`` tokens of ``vllm_sonnet/sonnet.txt`` in prompts of
  ``--text-tokens`` (the prompt logprobs of every position): perplexity, the mean and largest change of the true
  next token's logprob, and the top-1 (argmax) agreement with the float32 cache; then free-running greedy decoding
  of ``--greedy-tokens`` tokens after the first 64 tokens of each prompt: the share of tokens equal to the float32
  cache's before the first difference, and the share of prompts whose tokens are all equal.
- ``layouts``: the int8 scale per (token, KV head) -- what kvserve stores -- against one scale per token (all
  KV heads of a row), both simulated on a float32 cache (quantized, then dequantized, as the K/V are written):
  the same accuracy figures and the bytes per token. The first equals the real int8 cache bit for bit.
- ``pool``: tokens a pool of ``--pool-bytes`` holds per cache type.
- ``decode-8k``: batch-1 decode at ``--context`` tokens of context, one engine per cache type, their decode steps
  interleaved one by one in this process (the machine's drift hits both alike): median step time, tokens/s.
- ``attention`` (not in the default set): the paged-attention kernel alone at a batch-``--requests`` decode step
  of the default model's heads (or one ``--attention-prompt``-token prompt), per cache type and ISA build, the
  builds alternating call by call (the AMX build's paired ratio to the AVX-512 build's), optionally against
  ``--baseline-lib``, an older build of the library, with the outputs compared bit for bit (``measure_attention``).
- ``throughput``: ``--requests`` x ``--prompt-tokens``/``--output-tokens`` (random prompts, greedy, EOS ignored),
  one engine per cache type, steps interleaved: whole-run output tokens/s, the median decode step and its
  attention part (the fused layer loop's clock).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch

DTYPES = ("float32", "bfloat16", "int8")


# -------------------------------------------------------------------------------------------------- accuracy

def sonnet_prompts(tokenizer, data_dir, total: int, per_prompt: int) -> list[list[int]]:
    """The first ``total`` tokens of vllm_sonnet/sonnet.txt in prompts of ``per_prompt`` (the last shorter)."""
    path = Path(data_dir) / "vllm_sonnet" / "sonnet.txt"
    if not path.exists():
        raise ValueError(f"{path} not found: --data-dir must point at the shared data folder")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))[:total]
    return [ids[i: i + per_prompt] for i in range(0, len(ids), per_prompt) if len(ids[i: i + per_prompt]) > 1]


def logprobs_of_text(model, ids: list[int], kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing over ``ids`` with a cache of ``kv_dtype``: (logprob of each true next token ``[n - 1]``,
    argmax at each position ``[n - 1]``)."""
    from benchmarks.accuracy import all_logits

    lp = all_logits(model, ids, kv_dtype)[:-1].log_softmax(-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lp.argmax(-1)


def teacher_forced(model, texts, kv_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lps, tops = zip(*(logprobs_of_text(model, ids, kv_dtype) for ids in texts))
    return torch.cat(lps), torch.cat(tops)


def summarize(ref: tuple, got: tuple) -> dict:
    """Accuracy figures of ``got`` (logprobs, argmaxes) against the float32 cache's ``ref``."""
    d = (got[0] - ref[0]).abs()
    return {"ppl": math.exp(-float(got[0].mean())), "mean_abs_dlogprob": float(d.mean()),
            "max_abs_dlogprob": float(d.max()), "top1": float((got[1] == ref[1]).float().mean())}


def greedy_agreement(ref: list, got: list) -> tuple[float, float]:
    """(share of tokens equal before each prompt's first difference, share of prompts equal throughout)."""
    same = sum(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got))
    return same / sum(len(r) for r in ref), sum(r == g for r, g in zip(ref, got)) / len(ref)


def measure_accuracy(model_path, args, label: str) -> list[dict]:
    from kvserve import LLM, SamplingParams

    rows, ref_tf, ref_greedy, texts = [], None, None, None
    sp = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
    for kv in DTYPES:
        llm = LLM(model=model_path, kv_cache_dtype=kv, num_kv_blocks=256, num_threads=args.num_threads)
        if texts is None:
            texts = sonnet_prompts(llm.get_tokenizer(), args.data_dir, args.total_tokens, args.text_tokens)
        tf = teacher_forced(llm.llm_engine.model, texts, llm.llm_engine.kv_cache_dtype)
        greedy = [o.outputs[0].token_ids for o in llm.generate([t[:64] for t in texts], sp)]
        ref_tf, ref_greedy = (tf, greedy) if ref_tf is None else (ref_tf, ref_greedy)
        tokens, whole = greedy_agreement(ref_greedy, greedy)
        rows.append({"model": label, "kv": kv, "positions": len(tf[0]), **summarize(ref_tf, tf),
                     "greedy_tokens": tokens, "greedy_prompts": whole})
        print(_accuracy_row(rows[-1]), flush=True)
        del llm
    return rows


def _accuracy_row(r: dict) -> str:
    return (f"| {r['model']} | {r['kv']} | {r['ppl']:.3f} | {r['mean_abs_dlogprob']:.4f} | "
            f"{r['max_abs_dlogprob']:.3f} | {r['top1']:.2%} | {r['greedy_tokens']:.1%} | {r['greedy_prompts']:.0%} |")


# ---------------------------------------------------------------------------------------------------- layouts

def _fake_int8(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """``x [T, H, D]`` quantized and dequantized as an int8 cache would (kv_layout), one scale per (token, head)
    or, ``per_token``, one per token over all its heads."""
    from kvserve.attention.kv_layout import dequantize_int8, quantize_int8

    rows = x.reshape(x.shape[0], -1) if per_token else x
    return dequantize_int8(quantize_int8(rows)).view_as(x)


def measure_layouts(args) -> list[dict]:
    """The two scale layouts simulated on the default model's float32 cache (Python layer loop, K/V written
    through ``write_kv`` after quantizing and dequantizing them)."""
    from kvserve import LLM
    from kvserve.attention.base import AttentionBackend

    llm = LLM(num_kv_blocks=256, num_threads=args.num_threads)
    model = llm.llm_engine.model
    texts = sonnet_prompts(llm.get_tokenizer(), args.data_dir, args.total_tokens, args.text_tokens)
    ref = teacher_forced(model, texts, torch.float32)
    real = teacher_forced(model, texts, torch.int8)
    attn, fused, rows = model.attn, model.fused_layers, []
    a, h = model.arch, model.num_kv_heads

    class Simulated(type(attn)):
        def forward_qkv(self, *args, **kw):  # the PyTorch ops (so write_kv runs), then this backend's attention
            return AttentionBackend.forward_qkv(self, *args, **kw)

        def write_kv(self, kv_cache, k, v, batch):
            super().write_kv(kv_cache, _fake_int8(k, self.per_token), _fake_int8(v, self.per_token), batch)

    try:
        model.fused_layers = None
        for per_token in (False, True):
            model.attn = Simulated(attn.isa)
            model.attn.per_token = per_token
            got = teacher_forced(model, texts, torch.float32)
            nbytes = a.num_hidden_layers * 2 * (h * a.head_dim + (2 if per_token else 2 * h))
            rows.append({"layout": "per token" if per_token else "per (token, KV head)", "bytes": nbytes,
                         **summarize(ref, got), "equals_int8_cache": torch.equal(got[0], real[0])})
            print(rows[-1], flush=True)
    finally:
        model.attn, model.fused_layers = attn, fused
    return rows


# ------------------------------------------------------------------------------------------------------ speed

def pool_tokens(model, budget: int, block_size: int = 16) -> dict:
    return {kv: budget // model.bytes_per_block(block_size, getattr(torch, kv)) * block_size for kv in DTYPES}


def _engines(kvs, args, **kw) -> dict:
    from kvserve import LLM

    return {kv: LLM(kv_cache_dtype=kv, num_threads=args.num_threads, **kw).llm_engine for kv in kvs}


def _interleaved(engines: dict, on_step=None) -> dict:
    """Step every engine until done, alternating which steps first; returns ``{kv: [(seconds, pure decode)]}``."""
    kvs, times = list(engines), {kv: [] for kv in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for kv in (kvs if len(times[kvs[0]]) % 2 else kvs[::-1]):
            e = engines[kv]
            if not e.has_unfinished_requests():
                continue
            s = e.scheduler
            pure = not s.waiting and all(r.output_token_ids for r in s.running)
            before = None if e.model.fused_layers is None or e.model.fused_layers.timings is None else \
                e.model.fused_layers.timings.clone()
            t = time.perf_counter()
            e.step()
            times[kv].append((time.perf_counter() - t, pure,
                              None if before is None else (e.model.fused_layers.timings - before).tolist()))
    return times


def measure_decode_long(args) -> list[dict]:
    from kvserve import SamplingParams

    kvs = args.speed_dtypes.split(",")
    blocks = -(-(args.context + args.decode_steps + 16) // 16)
    engines = _engines(kvs, args, num_kv_blocks=blocks, max_model_len=blocks * 16, max_num_seqs=1)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.context)]
    sp = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        e.add_request(prompt, sp, request_id="long")
    times = _interleaved(engines)
    rows = []
    for kv in kvs:
        dec = [t for t, pure, _ in times[kv] if pure]
        rows.append({"kv": kv, "context": args.context, "steps": len(dec), "median_ms": statistics.median(dec) * 1e3,
                     "tok_s": 1 / statistics.median(dec)})
        print(rows[-1], flush=True)
    return rows


def measure_throughput(args) -> list[dict]:
    from kvserve import SamplingParams

    kvs = args.speed_dtypes.split(",")
    n, p, o = args.requests, args.prompt_tokens, args.output_tokens
    engines = _engines(kvs, args, num_kv_blocks=n * (-(-(p + o) // 16)) + 16, max_num_seqs=n)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(p)] for _ in range(n)]
    sp = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        if e.model.fused_layers is not None:
            e.model.fused_layers.timings = torch.zeros(3, dtype=torch.int64)
        for i, ids in enumerate(prompts):
            e.add_request(ids, sp, request_id=str(i))
    times = _interleaved(engines)
    rows = []
    for kv in kvs:
        total = sum(t for t, _, _ in times[kv])
        dec = [(t, parts) for t, pure, parts in times[kv] if pure]
        attn = statistics.median(x[1] for _, x in dec) / 1e6 if dec and dec[0][1] is not None else float("nan")
        rows.append({"kv": kv, "total_s": total, "out_tok_s": n * o / total,
                     "decode_median_ms": statistics.median(t for t, _ in dec) * 1e3, "attention_ms": attn})
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------------------ attention kernel

def decode_batch(requests: int, seed: int = 0, lo: int = 129, hi: int = 257, h_q: int = 9, h_kv: int = 3,
                 d: int = 64, bs: int = 16, prompt: int = 0) -> dict:
    """A decode step's attention inputs as the default model's (9 query heads over 3 KV heads of 64) at batch
    ``requests``: contexts of ``lo .. hi - 1`` keys in scattered blocks, a float32 pool and its bfloat16 and int8
    copies. ``prompt`` > 0: instead one request's whole prompt of that many tokens (every row a query)."""
    from kvserve.attention.kv_layout import quantize_int8

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([prompt]) if prompt else torch.randint(lo, hi, (requests,), generator=g)
    requests = len(lens)
    nblk = [-(-int(n) // bs) for n in lens]
    perm = torch.randperm(sum(nblk), generator=g)
    tables = torch.zeros(requests, max(nblk), dtype=torch.int64)
    o = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[o: o + n]
        o += n
    cache = torch.randn(2, sum(nblk), bs, h_kv, d, generator=g)
    q_len = lens.to(torch.int64) if prompt else torch.ones(requests, dtype=torch.int64)
    return {"q": torch.randn(int(q_len.sum()), h_q, d, generator=g), "tables": tables, "seq": lens.to(torch.int64),
            "q_len": q_len, "q_start": torch.cumsum(q_len, 0) - q_len,
            "caches": {"f32": cache, "bf16": cache.to(torch.bfloat16), "i8": quantize_int8(cache)}, "bs": bs}


def _attend(lib, x: dict, kind: str, isa: str, out: torch.Tensor) -> None:
    import ctypes

    q, c, t, n = x["q"], x["caches"][kind], x["tables"], x["seq"].shape[0]
    ones, starts = x["q_len"], x["q_start"]
    fn = getattr(lib, f"kvserve_paged_attention_{kind}_{isa}")
    fn.restype = ctypes.c_int
    rc = fn(ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(q.stride(0)), ctypes.c_void_p(c[0].data_ptr()),
            ctypes.c_void_p(c[1].data_ptr()), ctypes.c_void_p(t.data_ptr()), ctypes.c_int64(t.shape[1]),
            ctypes.c_void_p(starts.data_ptr()), ctypes.c_void_p(ones.data_ptr()),
            ctypes.c_void_p(x["seq"].data_ptr()), *(ctypes.c_int64(v) for v in (n, q.shape[1], c.shape[3],
                                                                                 q.shape[2], x["bs"])),
            ctypes.c_float(q.shape[2] ** -0.5), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(out.stride(0)),
            ctypes.c_int64(0), ctypes.c_float(0.0), ctypes.c_void_p(None))  # no window, cap or sinks
    assert rc == 0


def measure_attention(args) -> list[dict]:
    """The paged-attention kernel alone on a batch-``--requests`` decode step of the default model's heads (one
    layer; ``--attention-prompt N``: one request's N-token prompt instead), per cache type and ISA build, caches
    evicted (a 64 MiB write) before every call, the builds (and with ``--baseline-lib``, an older build of the
    library, whose outputs are compared bit for bit) alternating call by call. Times: the 10th / 30th / 50th
    percentile of ``--rounds`` calls (a loaded host's descheduled calls land above them; ``new_ms_...``: this
    checkout's library, ``old_ms_...``: the baseline's), the median of the paired new / old ratios, and for the AMX
    build ``amx_over_avx512``, the median of its per-call ratios to the AVX-512 build's calls."""
    import ctypes

    from kvserve.kernels import cpu as cpu_kernels

    libs = {"new": cpu_kernels.load()}
    if args.baseline_lib:
        libs["old"] = ctypes.CDLL(args.baseline_lib)
    x, big, rows = decode_batch(args.requests, prompt=args.attention_prompt), torch.zeros(16 * 2**20), []
    isas = cpu_kernels.attention_isas()
    for kind in ("f32", "bf16", "i8"):
        runs = [(n, isa) for isa in isas for n in libs if hasattr(libs[n], f"kvserve_paged_attention_{kind}_{isa}")]
        outs = {r: torch.empty_like(x["q"]) for r in runs}
        times = {r: [] for r in runs}
        for i in range(args.rounds):
            for r in (runs if i % 2 else runs[::-1]):
                big.add_(1.0)
                t = time.perf_counter()
                _attend(libs[r[0]], x, kind, r[1], outs[r])
                times[r].append(time.perf_counter() - t)
        for isa in isas:
            here = [r for r in runs if r[1] == isa]
            q = {n: [statistics.quantiles(times[(n, isa)], n=10)[i] * 1e3 for i in (0, 2, 4)] for n, _ in here}
            row = {"kv": kind, "isa": isa, **{f"{n}_ms_p10_p30_p50": [round(v, 3) for v in q[n]] for n in q}}
            if ("old", isa) in times:
                row["same_bits"] = torch.equal(outs[("old", isa)].view(torch.int32), outs[("new", isa)].view(torch.int32))
                row["new_over_old"] = statistics.median(a / b for a, b in zip(times[("new", isa)], times[("old", isa)]))
            if isa == "amx":
                row["amx_over_avx512"] = round(statistics.median(
                    a / b for a, b in zip(times[("new", "amx")], times[("new", "avx512")])), 3)
            rows.append(row)
            print(row, flush=True)
    return rows


# ------------------------------------------------------------------------------------------------------ main

def parse_args(argv=None) -> argparse.Namespace:
    from kvserve.bench.workloads import default_data_dir

    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache_dtype", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", default="accuracy,layouts,pool,decode-8k,throughput",
                   help="comma-separated, of accuracy, layouts, pool, decode-8k, throughput and attention (not in "
                        "the default set); each is described above")
    p.add_argument("--model", default=None, help="GGUF for the accuracy measurement (default: the default model)")
    p.add_argument("--random-1b", action="store_true", help="also a random-weight Llama-3.2-1B-shaped Q4_0 GGUF")
    p.add_argument("--skip-default", action="store_true", help="accuracy: not the --model / default model")
    p.add_argument("--out-dir", default="/tmp", help="where the 1B file is written (kept and reused)")
    p.add_argument("--data-dir", default=str(default_data_dir()))
    p.add_argument("--total-tokens", type=int, default=6030)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--pool-bytes", type=int, default=4 * 1024**3)
    p.add_argument("--speed-dtypes", default="bfloat16,int8", help="cache types the speed measurements compare")
    p.add_argument("--context", type=int, default=8192 - 64)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=100, help="calls per library and case (attention)")
    p.add_argument("--attention-prompt", type=int, default=0, help="attention: one request's prompt of this many "
                   "tokens instead of the batch-``--requests`` decode step")
    p.add_argument("--baseline-lib", default=None, help="an older build of the kernels' library (attention): "
                   "timed against this one, call by call, and its outputs compared bit for bit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    what = set(args.measure.split(","))
    if "accuracy" in what:
        print("| model | KV cache | perplexity | mean abs dlogprob | max abs dlogprob | top-1 vs float32 | greedy "
              "tokens before first difference | greedy prompts identical |\n|---|---|---:|---:|---:|---:|---:|---:|")
        if not args.skip_default:
            measure_accuracy(args.model, args, Path(args.model).name if args.model else "SmolLM2-135M Q4_1 (default)")
        if args.random_1b:
            from benchmarks.model_sizes import SHAPES, write_gguf

            path = Path(args.out_dir) / "random-llama-3.2-1b-q4_0.gguf"
            if not path.exists():
                write_gguf(path, SHAPES["1b"], "q4_0")
            measure_accuracy(str(path), args, "random Llama-3.2-1B Q4_0")
    if "layouts" in what:
        measure_layouts(args)
    if "pool" in what:
        from kvserve import LLM

        model = LLM(num_kv_blocks=8).llm_engine.model
        tokens = pool_tokens(model, args.pool_bytes)
        print("| KV cache | bytes per token | tokens in", args.pool_bytes, "bytes | vs bfloat16 |")
        for kv, n in tokens.items():
            print(f"| {kv} | {model.bytes_per_block(1, getattr(torch, kv))} | {n:,} | "
                  f"{n / tokens['bfloat16']:.3f}x |")
    if "decode-8k" in what:
        measure_decode_long(args)
    if "throughput" in what:
        measure_throughput(args)
    if "attention" in what:
        measure_attention(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
