"""``python -m benchmarks.model_sizes``: kvserve against llama.cpp on random-weight GGUFs of Llama-3.2-1B and -3B
shapes, and of the mixture-of-experts OLMoE-1B-7B, Qwen3-30B-A3B (``--sizes olmoe-1b-7b``) and gpt-oss-20b
(``--sizes gpt-oss-20b --formats mxfp4``: MXFP4 experts, Q8_0 elsewhere, as llama.cpp's converter writes it), in one
run.

Each file is written in seconds (``write_gguf``): the real architecture (llama.cpp's tensor names and metadata,
``llama3`` RoPE scaling as the ``rope_freqs.weight`` divisors llama.cpp's converter stores, tied embeddings as in
Llama 3.2), SmolLM2's tokenizer (its vocabulary of 49,152 and every ``tokenizer.*`` key copied from the default
model's GGUF), and random but valid quantized blocks with sane float16 scales: a decode step's speed does not
depend on the weights' values. Formats (``FORMATS``): ``q4_0`` and ``q8_0`` (every matrix in that format),
``q4_k_m`` (llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the tied embedding / LM head and for ``attn_v`` and
``ffn_down`` in the layers llama-quantize gives more bits: the first and last eighth and every third between);
``q2_k`` and ``q3_k`` (every matrix Q2_K / Q3_K, the tied embedding / LM head Q6_K as llama-quantize keeps it;
simpler than its Q2_K and Q3_K_S mixes; not in the default ``--formats``).

Then per file, kvserve (one engine, the default quantization) and llama.cpp (``llama-cpp-python`` run by another
interpreter, ``--llama-python``, in a subprocess) in turn, the same thread count, greedy, EOS ignored:

- batch-1 decode: tokens/s after a ``--prompt-tokens`` prompt, over ``--decode-tokens`` tokens ((last - first
  token time) / (tokens - 1), best of ``--rounds``), against the machine's read-bandwidth bound
  (``benchmarks.roofline.bounds``: the weights' bytes plus the K/V of the mean context, over ``torch.sum``'s read
  bandwidth, ``benchmarks.quant_kernels.read_bandwidth_gbs``);
- prefill: tokens/s of one ``--prefill-tokens`` prompt (best of ``--rounds``; a fresh random prompt each round);
- with ``--prefill-activations int8``, kvserve's prefill again on an engine with ``quant_activations="int8"``:
  llama.cpp's activation precision (one int8 per value and a scale per 32; kvserve's default on AVX-512 and AMX is
  ``int8x2``, 15 bits a value, twice the integer products);
- ``--cpu-isa avx2``: kvserve's AVX2 kernels (matmuls and attention) on a CPU that has more;
- kvserve only (llama-cpp-python serialises requests): output tokens/s of ``--concurrency`` requests of
  ``--prompt-tokens`` / ``--decode-tokens`` submitted at once;
- ``--measure moe_ab`` (a mixture of experts, kvserve only): batch-1 decode step time with the routed experts on
  the grouped kernel (``kvserve.layers.grouped_experts``) and on one matmul call per chosen expert and projection
  (the path before it), interleaved on the same engine, ``--rounds`` each, and whether their tokens agree.

Results: docs/performance.md ("1B and 3B models").
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Layer shapes of the models measured (Llama-3.2 configs; the vocabulary is SmolLM2's, from its tokenizer).
@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes: ``layers``, ``hidden`` (embedding width), ``heads`` / ``kv_heads`` (attention
    heads, head width ``hidden // heads``), ``ffn`` (MLP width); RoPE base ``rope_theta`` with Llama 3's scaling
    (``rope_factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_context``)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 500000.0
    rope_factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    context: int = 131072
    arch: str = "llama"
    head_width: int = 0
    experts: int = 0
    experts_used: int = 0
    qk_norm: str = ""
    window: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden // self.heads

    @property
    def llama3_rope(self) -> bool:
        """Llama 3's RoPE scaling (``rope_freqs.weight``): the ``llama`` shapes only."""
        return self.arch == "llama"


#: A mixture of experts (``experts`` > 0) has ``ffn`` = one expert's width, a float32 router ``ffn_gate_inp`` with
#: random logits (tokens choose varied experts, as a trained router's do), the experts stacked as
#: ``ffn_{gate,up,down}_exps``, an untied LM head, and ``qk_norm`` (``head``: per head, Qwen3; ``proj``: over the
#: whole projection, OLMoE). ``gpt-oss`` adds its attention sinks, biases (attention, router, experts), the window
#: (``window``) on every other layer, YaRN and ``post_attention_norm`` for the pre-MLP norm.
SHAPES = {"1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192),
          "3b": Shape(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192),
          "olmoe-1b-7b": Shape(layers=16, hidden=2048, heads=16, kv_heads=16, ffn=1024, rope_theta=10000.0,
                               context=4096, arch="olmoe", experts=64, experts_used=8, qk_norm="proj"),
          "qwen3-30b-a3b": Shape(layers=48, hidden=2048, heads=32, kv_heads=4, ffn=768, rope_theta=1e6,
                                 context=40960, arch="qwen3moe", head_width=128, experts=128, experts_used=8,
                                 qk_norm="head"),
          "gpt-oss-20b": Shape(layers=24, hidden=2880, heads=64, kv_heads=8, ffn=2880, rope_theta=150000.0,
                               rope_factor=32.0, original_context=4096, arch="gpt-oss", head_width=64, experts=32,
                               experts_used=4, window=128)}
#: File format -> (GGUF ``general.file_type``, llama.cpp's name of it).
FORMATS = {"q4_0": (2, "Q4_0"), "q4_k_m": (15, "Q4_K_M"), "q8_0": (7, "Q8_0"), "q2_k": (10, "Q2_K"),
           "q3_k": (11, "Q3_K_S"), "mxfp4": (38, "MXFP4_MOE")}
#: The formats measured when ``--formats`` is not given.
DEFAULT_FORMATS = ["q4_0", "q4_k_m", "q8_0"]
#: The interpreter with ``llama_cpp`` (built outside the project): ``$KVSERVE_LLAMA_PYTHON`` or this venv's.
LLAMA_PYTHON = os.environ.get("KVSERVE_LLAMA_PYTHON", "/tmp/llamacpp-venv/bin/python")


# ---------------------------------------------------------------------------------------------------- the files


def more_bits(layer: int, layers: int) -> bool:
    """Whether llama-quantize's Q4_K_M gives layer ``layer`` of ``layers`` Q6_K ``attn_v`` / ``ffn_down``: the first
    and last eighth of the layers and every third layer between (about half of them)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(shape: Shape, fmt: str) -> dict:
    """GGML type of each quantized tensor of a ``fmt`` file (``FORMATS``): name -> ``GGMLQuantizationType``.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    from gguf import GGMLQuantizationType as T

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {fmt!r}")
    base = {"q4_0": T.Q4_0, "q4_k_m": T.Q4_K, "q8_0": T.Q8_0, "q2_k": T.Q2_K, "q3_k": T.Q3_K, "mxfp4": T.Q8_0}[fmt]
    if fmt == "mxfp4" and not shape.experts:
        raise ValueError("format mxfp4 is a mixture of experts' (MXFP4 experts, Q8_0 elsewhere)")
    head = T.Q6_K if fmt in ("q4_k_m", "q2_k", "q3_k") else base
    out = {"token_embd.weight": head}
    if shape.experts:
        out["output.weight"] = head
    ffn = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if shape.experts else ("ffn_gate", "ffn_up", "ffn_down")
    for i in range(shape.layers):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output") + ffn:
            six = fmt == "q4_k_m" and kind in ("attn_v", ffn[2]) and more_bits(i, shape.layers)
            mx4 = fmt == "mxfp4" and kind in ffn
            out[f"blk.{i}.{kind}.weight"] = T.Q6_K if six else T.MXFP4 if mx4 else base
    return out


def _matrix_shape(name: str, shape: Shape, vocab: int) -> tuple:
    """``(rows, columns)`` of a matrix: rows = output features (the GGUF ``ne[1]``), columns = input features; the
    stacked experts' ``(experts, rows, columns)``."""
    kv, q = shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    e = (shape.experts,)
    return {"token_embd": (vocab, shape.hidden), "output": (vocab, shape.hidden), "attn_q": (q, shape.hidden),
            "attn_k": (kv, shape.hidden), "attn_v": (kv, shape.hidden), "attn_output": (shape.hidden, q),
            "ffn_gate": (shape.ffn, shape.hidden), "ffn_up": (shape.ffn, shape.hidden),
            "ffn_down": (shape.hidden, shape.ffn), "ffn_gate_exps": e + (shape.ffn, shape.hidden),
            "ffn_up_exps": e + (shape.ffn, shape.hidden), "ffn_down_exps": e + (shape.hidden, shape.ffn)}[kind]


def random_blocks(qtype, n: int, rng):
    """``n`` random valid blocks of ``qtype`` (Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, MXFP4) as ``uint8 [n, bytes_per_block]``: random
    quants and sub-scales, float16 scales set to small normal values (weights of magnitude ~0.02, never inf/nan).

    Raises:
        ValueError: another type.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    tb = GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (n, tb), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, (n, 1)).astype("<f2").view(np.uint8)

    if qtype == T.Q4_0:      # d, qs[16]: w = d (q - 8)
        b[:, 0:2] = f16(2e-3, 8e-3)
    elif qtype == T.Q8_0:    # d, qs[32] int8: w = d q
        b[:, 0:2] = f16(1e-4, 4e-4)
    elif qtype == T.Q4_K:    # d, dmin, scales[12] (6-bit), qs[128]: w = d sc q - dmin m
        b[:, 0:2] = f16(7e-5, 1.5e-4)
        b[:, 2:4] = f16(4e-4, 8e-4)
    elif qtype == T.Q6_K:    # ql[128], qh[64], scales[16] int8, d: w = d sc (q - 32)
        b[:, 192:208] = rng.integers(-16, 17, (n, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = f16(7e-5, 1.5e-4)
    elif qtype == T.Q2_K:    # scales[16] (4-bit sc, mn), qs[64], d, dmin: w = d sc q - dmin mn
        b[:, 80:82] = f16(3e-4, 6e-4)
        b[:, 82:84] = f16(3e-4, 6e-4)
    elif qtype == T.Q3_K:    # hmask[32], qs[64], scales[12] (6-bit), d: w = d (s - 32) q3
        b[:, 108:110] = f16(1e-4, 2e-4)
    elif qtype == T.MXFP4:   # e (E8M0), qs[16]: w = e2m1(q) 2^(e - 127)
        b[:, 0] = rng.integers(127 - 9, 127 - 6, n)
    else:
        raise ValueError(f"random_blocks writes Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K and MXFP4, got {T(qtype).name}")
    return b


def llama3_rope_factors(shape: Shape) -> list:
    """Llama 3.1's RoPE scaling as per-frequency divisors of ``theta_i = base^(-2i/d)`` (what llama.cpp's converter
    stores as ``rope_freqs.weight``, ``d/2`` floats): 1 for wavelengths under ``original_context /
    high_freq_factor``, ``rope_factor`` above ``original_context / low_freq_factor``, a smooth blend between
    (Meta's ``apply_scaling`` in the Llama 3.1 reference code)."""
    out = []
    lo_wave = shape.original_context / shape.low_freq_factor
    hi_wave = shape.original_context / shape.high_freq_factor
    for i in range(shape.head_dim // 2):
        wave = 2 * math.pi * shape.rope_theta ** (2 * i / shape.head_dim)
        if wave < hi_wave:
            out.append(1.0)
        elif wave > lo_wave:
            out.append(shape.rope_factor)
        else:
            smooth = (shape.original_context / wave - shape.low_freq_factor) / (
                shape.high_freq_factor - shape.low_freq_factor)
            out.append(1.0 / ((1 - smooth) / shape.rope_factor + smooth))
    return out


@functools.lru_cache(maxsize=2)
def tokenizer_fields(source=None) -> tuple:
    """``[(key, value, GGUFValueType, array sub-type)]`` of every ``tokenizer.*`` key of ``source`` (default: the
    default model's GGUF, SmolLM2's tokenizer)."""
    import gguf

    from kvserve.model.loader import default_model_path

    reader = gguf.GGUFReader(str(source or default_model_path()))
    out = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return tuple(out)


def write_gguf(path, shape: Shape, fmt: str, seed: int = 0, tokenizer_source=None) -> Path:
    """Write a random-weight Llama GGUF of ``shape`` in ``fmt`` (``FORMATS``) to ``path``; returns the path.

    Norm weights are 1.0 (float32); each quantized matrix takes consecutive blocks, from a random start, of a pool
    of ~2^20 random blocks per type (``random_blocks``), so a 3B file takes seconds. The vocabulary and the
    ``tokenizer.*`` metadata come from ``tokenizer_source`` (default: the default model's GGUF).

    Raises:
        ValueError: an unknown ``fmt``, or a width that is not a multiple of the format's block.
    """
    import gguf
    import numpy as np

    types = tensor_types(shape, fmt)
    tok = tokenizer_fields(tokenizer_source)
    vocab = len(next(v for k, v, _, _ in tok if k == "tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {shape.arch} {shape.layers}x{shape.hidden} ({FORMATS[fmt][1]}, benchmarks.model_sizes)")
    w.add_file_type(FORMATS[fmt][0])
    w.add_quantization_version(2)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if shape.window:
        w.add_uint32(f"{shape.arch}.attention.sliding_window", shape.window)
    if shape.arch == "gpt-oss":
        w.add_string(f"{shape.arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{shape.arch}.rope.scaling.factor", shape.rope_factor)
        w.add_uint32(f"{shape.arch}.rope.scaling.original_context_length", shape.original_context)
    if shape.experts:
        w.add_uint32(f"{shape.arch}.expert_count", shape.experts)
        w.add_uint32(f"{shape.arch}.expert_used_count", shape.experts_used)
        w.add_uint32(f"{shape.arch}.expert_feed_forward_length", shape.ffn)
    for key, val, vtype, sub in tok:
        w.add_key_value(key, val, vtype, sub_type=sub)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    tensors = [("token_embd.weight", None)]
    if shape.llama3_rope:
        tensors.append(("rope_freqs.weight", np.asarray(llama3_rope_factors(shape), np.float32)))
    ffn = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if shape.experts else ("ffn_gate", "ffn_up", "ffn_down")
    q_norm = {"head": shape.head_dim, "proj": shape.heads * shape.head_dim}.get(shape.qk_norm)
    k_norm = {"head": shape.head_dim, "proj": shape.kv_heads * shape.head_dim}.get(shape.qk_norm)
    gpt_oss = shape.arch == "gpt-oss"  # sinks, biases, post_attention_norm
    small = lambda *dims: rng.standard_normal(dims, dtype=np.float32) * 0.02  # noqa: E731
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        tensors.append((f"blk.{i}.attn_norm.weight", ones(shape.hidden)))
        tensors += [(f"blk.{i}.{k}.weight", None) for k in ("attn_q", "attn_k", "attn_v", "attn_output")]
        if gpt_oss:
            tensors += [(f"blk.{i}.attn_{k}.bias", small(n)) for k, n in (("q", q), ("k", kv), ("v", kv),
                                                                          ("output", shape.hidden))]
            tensors.append((f"blk.{i}.attn_sinks.weight", small(shape.heads)))
        if q_norm:
            tensors += [(f"blk.{i}.attn_q_norm.weight", ones(q_norm)), (f"blk.{i}.attn_k_norm.weight", ones(k_norm))]
        tensors.append((f"blk.{i}.{'post_attention_norm' if gpt_oss else 'ffn_norm'}.weight", ones(shape.hidden)))
        if shape.experts:
            router = rng.standard_normal((shape.experts, shape.hidden), dtype=np.float32) * 0.05
            tensors.append((f"blk.{i}.ffn_gate_inp.weight", router))
        tensors += [(f"blk.{i}.{k}.weight", None) for k in ffn]
        if gpt_oss:
            tensors.append((f"blk.{i}.ffn_gate_inp.bias", small(shape.experts)))
            tensors += [(f"blk.{i}.{k}.bias", small(shape.experts, shape.hidden if k == ffn[2] else shape.ffn))
                        for k in ffn]
    tensors.append(("output_norm.weight", ones(shape.hidden)))
    if shape.experts:
        tensors.append(("output.weight", None))

    def byte_shape(name):
        *lead, cols = _matrix_shape(name, shape, vocab)
        bs, tb = gguf.GGML_QUANT_SIZES[types[name]]
        if cols % bs:
            raise ValueError(f"{name}: {cols} columns is not a multiple of {types[name].name}'s {bs}-value block")
        return (*lead, cols // bs * tb)

    for name, arr in tensors:
        if arr is None:
            bshape = byte_shape(name)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=types[name])
        else:
            w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pools = {t: random_blocks(t, 1 << 20 if shape.hidden >= 1024 else 1 << 14, rng) for t in set(types.values())}
    for name, arr in tensors:
        if arr is None:
            bshape = byte_shape(name)
            pool = pools[types[name]]
            n = int(np.prod(bshape)) // pool.shape[1]
            idx = (int(rng.integers(len(pool))) + np.arange(n)) % len(pool)
            arr = pool[idx].reshape(bshape)
        w.write_tensor_data(arr)
    w.close()
    return path


# ------------------------------------------------------------------------------------------------ measurements


def _prompt(rng, n: int, vocab: int) -> list:
    return [int(t) for t in rng.integers(100, vocab - 100, n)]


def kvserve_measure(path: Path, args, rng, num_threads: int, measure=None, **engine_kw) -> dict:
    """kvserve's figures on one file (one engine, the default quantization, ``args.cpu_isa``; ``engine_kw`` more
    engine arguments): ``decode_tps``, ``step_ms``, ``prefill_tps``, ``throughput`` (concurrency -> output tok/s),
    ``cost`` (``roofline.model_cost``), ``load_s``, for ``measure`` (default ``args.measure``)."""
    import torch

    from kvserve import LLM, SamplingParams
    from benchmarks.roofline import model_cost

    need = max([1, *args.concurrency]) * (args.prompt_tokens + args.decode_tokens + 16) // 16
    need = max(need, (args.prefill_tokens + 32) // 16) + 8
    t = time.perf_counter()
    llm = LLM(model=str(path), num_threads=num_threads, max_model_len=max(args.prefill_tokens, args.prompt_tokens
                                                                          + args.decode_tokens) + 16,
              num_kv_blocks=need, max_num_seqs=max([1, *args.concurrency]), enable_prefix_caching=False,
              cpu_isa=None if args.cpu_isa == "auto" else args.cpu_isa, **engine_kw)
    out = {"load_s": time.perf_counter() - t}
    measure = args.measure if measure is None else measure
    engine = llm.llm_engine
    out["cost"] = model_cost(engine.model, engine.kv_cache_dtype).__dict__
    vocab = engine.model.arch.vocab_size if hasattr(engine.model, "arch") else 49152
    llm.generate([_prompt(rng, 16, vocab)], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    if "decode" in measure:
        sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        tpots = [llm.generate([_prompt(rng, args.prompt_tokens, vocab)], sp)[0].metrics.tpot
                 for _ in range(args.rounds)]
        out["step_ms"] = 1e3 * min(tpots)
        out["decode_tps"] = 1 / min(tpots)
    if "prefill" in measure:
        sp = SamplingParams(temperature=0, max_tokens=1)
        best = float("inf")
        for _ in range(args.rounds):
            p = _prompt(rng, args.prefill_tokens, vocab)
            t = time.perf_counter()
            llm.generate([p], sp)
            best = min(best, time.perf_counter() - t)
        out["prefill_tps"] = args.prefill_tokens / best
    if "moe_ab" in measure:
        out["moe_ab"] = moe_ab(llm, args, rng, vocab)
    if "throughput" in measure:
        out["throughput"] = {}
        sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        for c in args.concurrency:
            prompts = [_prompt(rng, args.prompt_tokens, vocab) for _ in range(c)]
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t
            out["throughput"][c] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    del llm, engine
    torch.set_num_threads(num_threads)
    return out


def moe_ab(llm, args, rng, vocab: int) -> dict:
    """Batch-1 decode step ms of the grouped expert kernel and of the per-expert path (``MoE.grouped`` set and
    ``None``), alternating on one engine, ``args.rounds`` rounds, a fresh prompt each round (both paths the same
    one): ``{"grouped_ms": [...], "per_expert_ms": [...], "same_tokens": bool}``; empty for a dense model."""
    from kvserve import SamplingParams

    moes = [layer["moe"] for layer in llm.llm_engine.model.layers if layer.get("moe") is not None]
    grouped = [m.grouped for m in moes]
    if not moes or any(g is None for g in grouped):
        return {}
    sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    out = {"grouped_ms": [], "per_expert_ms": [], "same_tokens": True}
    try:
        for _ in range(args.rounds):
            p = _prompt(rng, args.prompt_tokens, vocab)
            ids = []
            for key, kernels in (("grouped_ms", grouped), ("per_expert_ms", [None] * len(moes))):
                for m, g in zip(moes, kernels):
                    m.grouped = g
                o = llm.generate([p], sp)[0]
                out[key].append(1e3 * o.metrics.tpot)
                ids.append(list(o.outputs[0].token_ids))
            out["same_tokens"] &= ids[0] == ids[1]
    finally:
        for m, g in zip(moes, grouped):
            m.grouped = g
    return out


def llama_worker(path: str, params: dict) -> dict:
    """llama.cpp's figures on one file (run under the interpreter with ``llama_cpp``; stdlib + ``llama_cpp`` only):
    ``decode_tps``/``step_ms`` (best of ``rounds``: a fresh context, ``prompt_tokens`` evaluated, then
    ``decode_tokens`` greedy tokens, timed from the first to the last) and ``prefill_tps``."""
    import random

    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=params["n_ctx"], n_threads=params["threads"],
                          n_threads_batch=params["threads"], verbose=False)
    out = {"load_s": time.perf_counter() - t, "version": llama_cpp.__version__,
           "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    rnd = random.Random(params["seed"])
    vocab = llm.n_vocab()
    prompt = lambda n: [rnd.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    if "decode" in params["measure"]:
        best = float("inf")
        for _ in range(params["rounds"]):
            llm.reset()
            times = []
            for _tok in llm.generate(prompt(params["prompt_tokens"]), top_k=1, temp=0.0, reset=True):
                times.append(time.perf_counter())
                if len(times) == params["decode_tokens"]:
                    break
            best = min(best, (times[-1] - times[0]) / (len(times) - 1))
        out["step_ms"], out["decode_tps"] = 1e3 * best, 1 / best
    if "prefill" in params["measure"]:
        best = float("inf")
        for _ in range(params["rounds"]):
            llm.reset()
            p = prompt(params["prefill_tokens"])
            t = time.perf_counter()
            llm.eval(p)
            best = min(best, time.perf_counter() - t)
        out["prefill_tps"] = params["prefill_tokens"] / best
    return out


def llama_measure(path: Path, args, num_threads: int) -> dict:
    """Run ``llama_worker`` on ``path`` under ``args.llama_python`` in a subprocess; its JSON, or ``{"error"}``."""
    params = {"threads": num_threads, "seed": args.seed, "measure": args.measure, "rounds": args.rounds,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "prefill_tokens": args.prefill_tokens,
              "n_ctx": max(args.prefill_tokens, args.prompt_tokens + args.decode_tokens) + 64}
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([args.llama_python, "-m", "benchmarks.model_sizes", "--llama-worker", str(path),
                           json.dumps(params)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit %d" % proc.returncode]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------ report


def _f(x, spec=".1f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows: list, concurrency: list, extra: tuple = ()) -> str:
    """Markdown table of ``run``'s per-file results (``extra``: the ``--prefill-activations`` measured)."""
    head = ["file", "MB", "bw bound ms", "decode tok/s kvserve / llama.cpp", "kvserve step / bound",
            "llama.cpp step / bound", "decode kvserve / llama.cpp", "prefill tok/s kvserve / llama.cpp",
            "prefill kvserve / llama.cpp"]
    for act in extra:
        head += [f"prefill tok/s kvserve {act}", f"prefill kvserve {act} / llama.cpp"]
    head += [f"{c} req. tok/s" for c in concurrency] + ["wall s"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        k, lc, bound = r["kvserve"], r["llama.cpp"], r.get("bandwidth_bound_ms")
        ratio = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
        cells = [r["file"], _f(r["mb"], ".0f"), _f(bound, ".1f"),
                 f"{_f(k.get('decode_tps'))} / {_f(lc.get('decode_tps'))}",
                 _f(ratio(k.get("step_ms"), bound), ".2f", "x"), _f(ratio(lc.get("step_ms"), bound), ".2f", "x"),
                 _f(ratio(k.get("decode_tps"), lc.get("decode_tps")), ".2f", "x"),
                 f"{_f(k.get('prefill_tps'), '.0f')} / {_f(lc.get('prefill_tps'), '.0f')}",
                 _f(ratio(k.get("prefill_tps"), lc.get("prefill_tps")), ".2f", "x")]
        for act in extra:
            tps = k.get(f"prefill_tps_{act}")
            cells += [_f(tps, ".0f"), _f(ratio(tps, lc.get("prefill_tps")), ".2f", "x")]
        cells += [_f((k.get("throughput") or {}).get(c)) for c in concurrency]
        cells.append(_f(r["wall_s"], ".0f"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _csv(kind):
    return lambda s: [kind(x.strip()) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_sizes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "kvserve-model-sizes"),
                   help="where the GGUFs are written (never the repository); existing files are reused")
    p.add_argument("--sizes", type=_csv(str), default=["1b", "3b"], help=f"comma-separated, of {tuple(SHAPES)}")
    p.add_argument("--formats", type=_csv(str), default=DEFAULT_FORMATS,
                   help=f"comma-separated, of {tuple(FORMATS)} (mxfp4: mixture-of-experts sizes only)")
    p.add_argument("--measure", type=_csv(str), default=["decode", "prefill", "throughput"],
                   help="comma-separated, of decode, prefill, throughput, moe_ab")
    p.add_argument("--engines", type=_csv(str), default=["kvserve", "llama.cpp"], help="comma-separated")
    p.add_argument("--write-only", action="store_true", help="write the files and stop")
    p.add_argument("--rewrite", action="store_true", help="write the files even if they exist")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt of the decode and throughput runs")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--prefill-tokens", type=int, default=1000, help="prompt of the prefill run")
    p.add_argument("--concurrency", type=_csv(int), default=[16, 64], help="kvserve throughput: requests at once")
    p.add_argument("--rounds", type=int, default=2, help="decode and prefill: best of this many")
    p.add_argument("--num-threads", type=int, default=None, help="both engines (None: torch's thread count)")
    p.add_argument("--cpu-isa", default="auto", choices=("auto", "amx_int8", "avx512_vnni", "avx2"),
                   help="kvserve's quantized-matmul path (e.g. avx2 to measure the AVX2 kernels on an AVX-512 CPU)")
    p.add_argument("--prefill-activations", type=_csv(str), default=[],
                   help="also measure kvserve's prefill with these quant_activations (e.g. bf16 on AMX-BF16, int8: llama.cpp's "
                        "activation precision), each on its own engine")
    p.add_argument("--llama-python", default=LLAMA_PYTHON, help="an interpreter with llama_cpp (llama-cpp-python)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--json", default=None, help="also write the raw numbers to this file")
    p.add_argument("--llama-worker", nargs=2, metavar=("FILE", "PARAMS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, vals, allowed in (("--sizes", args.sizes, SHAPES), ("--formats", args.formats, FORMATS),
                                ("--measure", args.measure, ("decode", "prefill", "throughput", "moe_ab")),
                                ("--engines", args.engines, ("kvserve", "llama.cpp")),
                                ("--prefill-activations", args.prefill_activations, ("int8", "int8x2", "bf16"))):
        bad = [v for v in vals if v not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; allowed: {', '.join(allowed)}")
    dense = [size for size in args.sizes if not SHAPES[size].experts]
    if "mxfp4" in args.formats and dense:
        p.error(f"--formats mxfp4 is for mixture-of-experts sizes (MXFP4 experts); not {dense}")
    if min(args.prompt_tokens, args.decode_tokens, args.prefill_tokens, args.rounds) < 1 or args.decode_tokens < 2:
        p.error("--prompt-tokens, --prefill-tokens and --rounds must be >= 1, --decode-tokens >= 2")
    if args.concurrency and min(args.concurrency) < 1:
        p.error("--concurrency values must be >= 1")
    return args


def _family(size: str) -> str:
    """The file-name prefix of a ``SHAPES`` entry: ``llama-3.2-`` for the dense sizes (the MoE sizes are named)."""
    return "llama-3.2-" if SHAPES[size].arch == "llama" else ""


def run(args: argparse.Namespace) -> int:
    """Write the files, measure each with both engines, print the machine, the table and the bandwidth."""
    import logging

    import numpy as np
    import torch

    from benchmarks.quant_kernels import read_bandwidth_gbs
    from benchmarks.roofline import ModelCost, bounds, cpu_info

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    threads = args.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    files = []
    for size in args.sizes:
        for fmt in args.formats:
            path = Path(args.out_dir) / f"random-{_family(size)}{size}-{fmt}.gguf"
            if args.rewrite or not path.exists():
                t = time.perf_counter()
                write_gguf(path, SHAPES[size], fmt, seed=args.seed)
                print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.1f} s",
                      flush=True)
            files.append(path)
    if args.write_only:
        return 0
    info = cpu_info()
    bw = read_bandwidth_gbs()
    print(f"CPU: {info['model']} ({info['cpus']} logical CPUs; {' '.join(info['flags'])}); {threads} threads for "
          f"both engines; read bandwidth {bw:.1f} GB/s (torch.sum)", flush=True)
    rng = np.random.default_rng(args.seed)
    rows, report = [], {"cpu": info, "threads": threads, "bandwidth_gbs": bw, "files": []}
    for path in files:
        t = time.perf_counter()
        row = {"file": path.name.removeprefix("random-").removeprefix("llama-3.2-").removesuffix(".gguf"),
               "mb": path.stat().st_size / 1e6, "kvserve": {}, "llama.cpp": {}}
        if "kvserve" in args.engines:
            row["kvserve"] = kvserve_measure(path, args, rng, threads)
            cost = ModelCost(**row["kvserve"]["cost"])
            ctx = args.prompt_tokens + args.decode_tokens // 2
            row["bandwidth_bound_ms"] = bounds(cost, 1, ctx, bw, 1.0).bandwidth_ms
            for act in args.prefill_activations if "prefill" in args.measure else ():
                row["kvserve"][f"prefill_tps_{act}"] = kvserve_measure(
                    path, args, rng, threads, ("prefill",), quant_activations=act)["prefill_tps"]
        if "llama.cpp" in args.engines:
            row["llama.cpp"] = llama_measure(path, args, threads)
            if "error" in row["llama.cpp"]:
                print(f"llama.cpp on {path.name}: {row['llama.cpp']['error']}", file=sys.stderr)
        row["wall_s"] = time.perf_counter() - t
        print(f"{row['file']}: {json.dumps({k: v for k, v in row.items() if k != 'file'}, default=str)}", flush=True)
        rows.append(row)
        report["files"].append(row)
    bw_after = read_bandwidth_gbs()
    report["bandwidth_gbs_after"] = bw_after
    lc = next((r["llama.cpp"] for r in rows if r["llama.cpp"].get("version")), {})
    print(f"\nCPU: {info['model']} ({' '.join(info['flags'])}), {threads} threads; read bandwidth {bw:.1f} GB/s "
          f"before, {bw_after:.1f} after (bounds use the first); llama-cpp-python {lc.get('version', 'n/a')}; "
          f"decode: {args.prompt_tokens}-token prompt, {args.decode_tokens} tokens, best of {args.rounds}; prefill: "
          f"{args.prefill_tokens} tokens; throughput: {args.prompt_tokens}/{args.decode_tokens} tokens per request\n")
    if lc.get("system_info"):
        print(f"llama.cpp {lc['system_info'].strip()}\n")
    print(format_table(rows, args.concurrency if "throughput" in args.measure else [],
                       tuple(args.prefill_activations) if "prefill" in args.measure else ()))
    for r in rows:
        ab = r["kvserve"].get("moe_ab")
        if ab:
            g, e = sorted(ab["grouped_ms"]), sorted(ab["per_expert_ms"])
            print(f"\n{r['file']} batch-1 decode step, interleaved ({args.rounds} rounds each): grouped expert kernel "
                  f"{g[len(g) // 2]:.1f} ms (best {g[0]:.1f}), per-expert calls {e[len(e) // 2]:.1f} ms (best "
                  f"{e[0]:.1f}): {e[len(e) // 2] / g[len(g) // 2]:.2f}x; same tokens: {ab['same_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.llama_worker:
        print(json.dumps(llama_worker(args.llama_worker[0], json.loads(args.llama_worker[1]))))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
