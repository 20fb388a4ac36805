"""``python -m benchmarks.prefix``: prefix caching on vs off, in one run, on four workloads.

(a) ``fewshot``: one shared few-shot prefix of >= 1,000 tokens (GSM8K train exemplars) + short test questions; a
    first request warms the cache, then the questions arrive together.
(b) ``multiround``: ShareGPT multi-round conversations (``sharegpt_multiround``): each round's input extends the
    previous one; rounds run as waves (every user's round k, then round k + 1).
(c) ``mooncake``: a slice of the Mooncake conversation trace; each ``hash_id`` (a 512-token block upstream) maps to
    a fixed random chunk of ``chunk_tokens`` tokens, so the hit rate an unbounded cache can reach is known
    exactly; requests run one after another and the measured hit rate is compared with it.
(d) ``nosharing``: random prompts that share nothing (0% hits): the cost of caching when it cannot help.

Each workload runs on two fresh engines (caching on / off): mean and p99 TTFT (of the requests after the first
wave), output tokens/s, prompt tokens actually computed, peak KV blocks and hit rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from benchmarks.driver import TimedRequest, drive
from kvserve.bench.workloads import SAFE_TOKEN_RANGE, default_data_dir
from kvserve.metrics import percentile


def _read_jsonl(path: Path) -> list:
    if not path.exists():
        raise ValueError(f"data file not found: {str(path)!r}; pass --data-dir")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fewshot_waves(tok, data_dir: Path, num_questions: int, num_shots: int = 8, output_len: int = 16) -> list:
    """Waves of ``TimedRequest``: [warm-up], [questions]; the shared prefix is ``num_shots`` GSM8K exemplars."""
    train = _read_jsonl(data_dir / "gsm8k" / "train_first200.jsonl")
    test = _read_jsonl(data_dir / "gsm8k" / "test.jsonl")
    prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:num_shots])
    ids = [tok.encode(prefix + f"Question: {r['question']}\nAnswer:") for r in test[: num_questions + 1]]
    reqs = [TimedRequest(f"fewshot-{i}", p, output_len) for i, p in enumerate(ids)]
    return [reqs[:1], reqs[1:]]


def multiround_waves(tok, data_dir: Path, num_users: int, max_input_tokens: int = 1024, output_len: int = 16) -> list:
    """Waves of rounds 2, 3, ... of the first ``num_users`` users whose rounds stay under ``max_input_tokens``."""
    base = data_dir / "sharegpt_multiround"
    for f in ("warmup.json", "run.json"):
        if not (base / f).exists():
            raise ValueError(f"data file not found: {str(base / f)!r}; pass --data-dir")
    warmup = json.loads((base / "warmup.json").read_text())
    run = json.loads((base / "run.json").read_text())
    waves: list = []
    users = 0
    for w in warmup:
        rounds = [w["input"]] + [r["input"] for r in run if r["input"].startswith(w["input"])]
        rounds.sort(key=len)
        ids = [tok.encode(text) for text in rounds]
        ids = [i for i in ids if len(i) <= max_input_tokens]
        if len(ids) < 3:
            continue
        for k, p in enumerate(ids):
            if len(waves) <= k:
                waves.append([])
            waves[k].append(TimedRequest(f"u{users}-r{k}", p, output_len))
        users += 1
        if users == num_users:
            break
    return waves


def mooncake_waves(data_dir: Path, num_requests: int, chunk_tokens: int, block_size: int, seed: int = 0,
                   length_scale: float = 16.0, output_len: int = 8) -> tuple:
    """One request per wave from the head of the Mooncake conversation trace, and the expected hit rate.

    Each request keeps ``ceil(input_length / length_scale)`` tokens (at most ``len(hash_ids) * chunk_tokens``); the
    expected hit rate is what an unbounded prefix cache finds, computed from the hash-id chains: the longest
    leading run of chunks that an earlier request also started with, in full blocks, capped so the last token is
    computed.
    """
    rows = _read_jsonl(data_dir / "mooncake" / "conversation_trace.jsonl")[:num_requests]
    rng = random.Random(seed)
    chunks: dict = {}
    seen_prefixes: set = set()
    waves, hit_tokens, query_tokens = [], 0, 0
    for i, r in enumerate(rows):
        h = r["hash_ids"]
        n_in = min(len(h) * chunk_tokens, max(1, -(-r["input_length"] // int(length_scale))))
        tokens = []
        for hid in h:
            if hid not in chunks:
                chunks[hid] = [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(chunk_tokens)]
            tokens += chunks[hid]
        tokens = tokens[:n_in]
        k = 0
        while k < len(h) and tuple(h[: k + 1]) in seen_prefixes:
            k += 1
        full_chunks = n_in // chunk_tokens  # only chunks complete in this request are complete blocks
        cached = min(k, full_chunks) * chunk_tokens
        cached = min(cached, (n_in - 1) // block_size * block_size)
        hit_tokens += cached
        query_tokens += n_in
        for j in range(1, full_chunks + 1):
            seen_prefixes.add(tuple(h[:j]))
        waves.append([TimedRequest(f"mc-{i}", tokens, output_len)])
    return waves, hit_tokens / query_tokens


def nosharing_waves(num_requests: int, seed: int = 0, input_len: int = 256, output_len: int = 32) -> list:
    """Random prompts that share no block, all at once: prefix caching can only cost here."""
    rng = random.Random(seed)
    return [[TimedRequest(f"ns-{i}", [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(input_len)], output_len)
             for i in range(num_requests)]]


def run_case(engine_args: dict, waves: list, caching: bool) -> dict:
    """Run the waves one after another on a fresh engine; returns the metrics (seconds, tokens)."""
    from kvserve import LLM, SamplingParams

    engine = LLM(**{**engine_args, "enable_prefix_caching": caching}).llm_engine
    engine.add_request([SAFE_TOKEN_RANGE[0]] * 8, SamplingParams(max_tokens=2))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.block_pool.reset_prefix_cache()
    engine.reset_stats()
    timelines = [drive(engine, wave, by="step") for wave in waves]
    measured = timelines[1:] if len(timelines) > 1 else timelines
    ttft = [tl.ttft(rid) for tl in measured for rid in tl.token_times]
    wall = sum(tl.wall_s for tl in timelines)
    out_tokens = sum(tl.output_tokens for tl in timelines)
    stats = engine.stats
    n_req = sum(len(w) for w in waves)
    return {
        "caching": caching, "mean_ttft_s": statistics.fmean(ttft), "p99_ttft_s": percentile(ttft, 99),
        "output_tokens_per_s": out_tokens / wall if wall else 0.0, "wall_s": wall,
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_computed": stats.num_computed_tokens_total - (out_tokens - n_req),
        "peak_kv_blocks": stats.peak_used_blocks, "hit_rate": stats.prefix_cache_hit_rate,
        "preemptions": stats.num_preemptions,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="fewshot,multiround,mooncake,nosharing")
    p.add_argument("--num-questions", type=int, default=8, help="fewshot: questions after the warm-up")
    p.add_argument("--num-users", type=int, default=3, help="multiround: conversations")
    p.add_argument("--num-mooncake", type=int, default=16, help="mooncake: requests from the trace head")
    p.add_argument("--chunk-tokens", type=int, default=32, help="mooncake: tokens per hash_id (upstream: 512)")
    p.add_argument("--num-nosharing", type=int, default=12)
    p.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.arg_utils import engine_kwargs
    from kvserve.model.loader import load_model

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    engine_args = {k: v for k, v in engine_kwargs(args).items() if k != "enable_prefix_caching"}
    tok = load_model(engine_args.get("model"), engine_args.get("dtype") or "float32").tokenizer
    results = {}
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        expected = None
        if name == "fewshot":
            waves = fewshot_waves(tok, data_dir, args.num_questions)
        elif name == "multiround":
            waves = multiround_waves(tok, data_dir, args.num_users)
        elif name == "mooncake":
            waves, expected = mooncake_waves(data_dir, args.num_mooncake, args.chunk_tokens, args.block_size,
                                             args.seed)
        elif name == "nosharing":
            waves = nosharing_waves(args.num_nosharing, args.seed)
        else:
            raise ValueError(f"unknown workload {name!r}; choose from fewshot, multiround, mooncake, nosharing")
        off = run_case(engine_args, waves, caching=False)
        on = run_case(engine_args, waves, caching=True)
        results[name] = {"off": off, "on": on, "expected_hit_rate": expected,
                         "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"],
                         "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                         "requests": sum(len(w) for w in waves)}
        print(format_result(name, results[name]), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


def format_result(name: str, r: dict) -> str:
    lines = [f"\n[{name}] {r['requests']} requests",
             f"{'caching':<9}{'TTFT mean ms':>14}{'TTFT p99 ms':>13}{'out tok/s':>11}{'prompt tok computed':>21}"
             f"{'peak blocks':>13}{'hit rate':>10}"]
    for key in ("off", "on"):
        c = r[key]
        lines.append(f"{key:<9}{c['mean_ttft_s'] * 1000:>14.0f}{c['p99_ttft_s'] * 1000:>13.0f}"
                     f"{c['output_tokens_per_s']:>11.1f}{c['prompt_tokens_computed']:>14}/{c['prompt_tokens']:<6}"
                     f"{c['peak_kv_blocks']:>13}{c['hit_rate'] * 100:>9.1f}%")
    lines.append(f"mean TTFT off/on: {r['ttft_speedup']:.2f}x   throughput on/off: {r['throughput_ratio']:.3f}")
    if r["expected_hit_rate"] is not None:
        lines.append(f"hit rate measured {r['on']['hit_rate'] * 100:.1f}% vs expected "
                     f"{r['expected_hit_rate'] * 100:.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    from benchmarks import engine_main

    raise SystemExit(engine_main("prefix", __doc__, add_args, run))
