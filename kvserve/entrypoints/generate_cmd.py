"""``kvserve generate``: run chat prompts (built-in set, ``--prompt``, or ``--prompts-file``) and print the
answers and a serving summary (throughput, TTFT, TPOT, batch size, KV usage and waste, preemptions)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve.entrypoints.prompts import BUILTIN_PROMPTS


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None,
                   help="a user message (chat template applied); repeatable. Default: the built-in prompts")
    p.add_argument("--prompts-file", default=None,
                   help="JSONL, one object per line with 'prompt' (raw text) or 'messages' (chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of tokens with this much "
                   "probability (default: 1.0, off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off; -1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the most likely's probability (default: 0.0, off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of every prompt's sampling generator (default: none: the engine's shared one)")
    p.add_argument("--json", action="store_true", help="print one JSON object (answers + summary) instead of text")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--report-memory", action="store_true",
                   help="print the peak RSS of each stage (imports, start-up, generation) and where the resident "
                        "memory is at the end: anonymous / file-backed / KV pool touched (kvserve.entrypoints.memory_report)")


def load_prompts_file(path: str) -> list:
    """Read ``--prompts-file``: each line ``{"prompt": str}`` or ``{"messages": [...]}``.

    Raises:
        ValueError: unreadable file or a line without either key (naming the line number).
    """
    items = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {path!r}: {e}") from e
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts-file line {i}: invalid JSON ({e})") from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            items.append(("prompt", obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            items.append(("messages", obj["messages"]))
        else:
            raise ValueError(f"--prompts-file line {i}: needs a 'prompt' string or a 'messages' list")
    if not items:
        raise ValueError(f"--prompts-file {path!r} has no prompts")
    return items


def summarize(outputs: list, stats, wall_time: float) -> dict:
    """The serving summary of one run (times in seconds)."""
    ttfts = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    bs = stats.block_size
    return {
        "requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": n_out,
        "wall_time_s": wall_time,
        "output_tokens_per_s": n_out / wall_time if wall_time > 0 else 0.0,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "mean_tpot_s": statistics.fmean(tpots) if tpots else None,
        "steps": stats.num_steps,
        "mean_running_batch_size": stats.mean_batch_size,
        "peak_kv_blocks_used": stats.peak_used_blocks,
        "kv_blocks_total": stats.num_blocks,
        "kv_waste": stats.kv_waste,
        "peak_paged_allocated_tokens": stats.peak_allocated_tokens,
        "peak_naive_reserved_tokens": stats.peak_naive_reserved_tokens,
        "peak_naive_reserved_blocks": -(-stats.peak_naive_reserved_tokens // bs),
        "preemptions": stats.num_preemptions,
    }


def format_summary(s: dict) -> str:
    ms = lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    return "\n".join([
        "=" * 72,
        f"requests                 {s['requests']}",
        f"prompt / output tokens   {s['prompt_tokens']} / {s['output_tokens']}",
        f"wall time                {s['wall_time_s']:.2f} s",
        f"output throughput        {s['output_tokens_per_s']:.1f} tokens/s",
        f"mean TTFT / TPOT         {ms(s['mean_ttft_s'])} / {ms(s['mean_tpot_s'])}",
        f"steps, mean batch size   {s['steps']}, {s['mean_running_batch_size']:.2f} running",
        f"peak KV blocks           {s['peak_kv_blocks_used']} used / {s['kv_blocks_total']} total",
        f"KV waste                 {s['kv_waste'] * 100:.1f}% of allocated slots unused (mean over steps)",
        f"naive reservation        {s['peak_naive_reserved_tokens']} tokens ({s['peak_naive_reserved_blocks']} blocks)"
        f" at peak vs {s['peak_paged_allocated_tokens']} tokens paged",
        f"preemptions              {s['preemptions']}",
    ])


def run(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.entrypoints.memory_report import MemoryProbe, format_memory, memory_report
    from kvserve.engine.arg_utils import engine_kwargs

    probe = MemoryProbe() if args.report_memory else None
    if probe is not None:
        probe.mark("imports")

    if args.prompts_file:
        items = load_prompts_file(args.prompts_file)
    else:
        items = [("messages", [{"role": "user", "content": p}]) for p in (args.prompt or BUILTIN_PROMPTS)]
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                        max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(**engine_kwargs(args))
    if probe is not None:
        probe.mark("LLM() start-up")
    # a chat template writes its own special tokens (BOS): tokenized without the tokenizer's, as LLM.chat does
    prompts = [llm.llm_engine.tokenize(llm.apply_chat_template(v), add_special_tokens=False) if kind == "messages"
               else v for kind, v in items]
    start = time.monotonic()
    outputs = llm.generate(prompts, sp, use_tqdm=not args.no_progress and not args.json)
    summary = summarize(outputs, llm.llm_engine.stats, time.monotonic() - start)
    memory = None
    if probe is not None:
        probe.mark("generation")
        memory = memory_report(probe, [getattr(llm.llm_engine.model_runner, "kv_cache", None)])
    if args.json:
        answers = [
            {"prompt": v if kind == "prompt" else v[-1]["content"], "text": o.outputs[0].text,
             "token_ids": o.outputs[0].token_ids, "finish_reason": o.outputs[0].finish_reason}
            for (kind, v), o in zip(items, outputs)
        ]
        result = {"outputs": answers, "summary": summary}
        if memory is not None:
            result["memory"] = memory
        print(json.dumps(result, indent=2))
        return 0
    for i, ((kind, v), o) in enumerate(zip(items, outputs)):
        question = v if kind == "prompt" else v[-1]["content"]
        c = o.outputs[0]
        print(f"\n[{i}] {question}\n--> {c.text.strip()}\n    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    print()
    print(format_summary(summary))
    if memory is not None:
        print(format_memory(memory))
    return 0
