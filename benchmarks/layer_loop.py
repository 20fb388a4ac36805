"""The decoder's layer loop three ways, side by side on one engine: ``python -m benchmarks.layer_loop``.

Batch-1 decode steps (128-token prompt, 64 tokens, EOS ignored) with the fused C loop
(``kvserve.model.fused_layers``), with the Python loop, and with ``torch.compile`` of the Python loop, interleaved
over ``--rounds`` rounds so that drift of a shared machine falls on all three. Prints the median ms per step.
The default model, or ``--model PATH``; ``--random qwen3|gemma3`` writes (once, into ``--out-dir``) a random-weight
checkpoint of that family at the shape of ``RANDOM_SHAPES`` (Qwen3-0.6B's / Gemma 3 1B's layer widths, fewer
layers, SmolLM2's vocabulary) and runs it with int8 weights quantized at load (``--quantization``).
Results: docs/performance.md, "Decode step breakdown" and "Layer spec".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams


def decode_ms(engine, tag: str, steps: int = 64, reps: int = 3) -> float:
    """Median ms per decode step of ``reps`` batch-1 requests (their prefill not counted)."""
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out = []
    for r in range(reps):
        engine.add_request(list(range(1000, 1128)), sp, request_id=f"{tag}-{r}-{time.monotonic_ns()}")
        while engine.scheduler.waiting or any(q.num_computed_tokens < q.num_prompt_tokens
                                              for q in engine.scheduler.running):
            engine.step()
        t, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        out.append((time.perf_counter() - t) / n * 1000)
    return statistics.median(out)


#: ``--random`` families: the ``transformers`` config class and its sizes (Qwen3-0.6B's and Gemma 3 1B's widths,
#: 12 layers, SmolLM2's 49152-token vocabulary so that the default tokenizer serves it).
RANDOM_SHAPES = {
    "qwen3": ("Qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)),
    "gemma3": ("Gemma3Text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=12,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                  sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4,
                                  final_logit_softcapping=None, tie_word_embeddings=True)),
}


def random_checkpoint(family: str, out_dir: str) -> Path:
    """A random-weight Hugging Face checkpoint of ``family`` (``RANDOM_SHAPES``) with the default model's
    tokenizer, written into ``out_dir/<family>`` unless it is there."""
    import transformers

    path = Path(out_dir) / family
    if (path / "config.json").exists():
        return path
    cls, sizes = RANDOM_SHAPES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(vocab_size=49152, max_position_embeddings=4096, bos_token_id=1,
                                                   eos_token_id=2, pad_token_id=0, **sizes)
    arch = "Gemma3ForCausalLM" if family == "gemma3" else f"{cls}ForCausalLM"
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    LLM(num_kv_blocks=16).get_tokenizer().save_pretrained(str(path))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2)")
    p.add_argument("--random", choices=tuple(RANDOM_SHAPES), default=None,
                   help="a random-weight checkpoint of this family instead of --model")
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "kvserve-layer-loop"))
    p.add_argument("--quantization", default=None, help="default: int8 with --random, else auto")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = p.parse_args(argv)
    model_path = str(random_checkpoint(args.random, args.out_dir)) if args.random else args.model
    quantization = args.quantization or ("int8" if args.random else "auto")
    engine = LLM(model=model_path, num_kv_blocks=256, max_num_seqs=4, num_threads=args.num_threads,
                 quantization=quantization).llm_engine
    model = engine.model
    fused, python_loop = model.fused_layers, model._layer_loop
    if fused is None:
        raise SystemExit("this engine runs no fused loop (kernels unavailable or fused_layers off)")
    variants = {"fused C loop": (fused, python_loop), "Python loop": (None, python_loop)}
    if not args.no_compile:
        variants["torch.compile(Python loop)"] = (None, torch.compile(python_loop, dynamic=True))
    results = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (loop, layer_loop) in variants.items():
            model.fused_layers, model._layer_loop = loop, layer_loop
            results[name].append(decode_ms(engine, name))
    model.fused_layers, model._layer_loop = fused, python_loop
    for name, values in results.items():
        print(f"{name:<28} median {statistics.median(values):6.2f} ms/step  rounds {[round(v, 2) for v in values]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
