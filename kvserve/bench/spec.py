"""``kvserve bench spec``: speculative decoding on Spec-Bench (``../shared/data/spec_bench``), no speculation vs the
n-gram proposer, at batch 1 and batch 8, in one run.

Per category (summarization, rag, translation, qa, math_reasoning, mt_bench): the first turn of ``--per-category``
questions through the chat template, greedy, ``--max-tokens`` new tokens. Reported: wall-clock output tokens/s and
the speedup over no speculation, acceptance rate, mean accepted length (tokens per verification pass), and target
forward passes (engine steps) per output token.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvserve.bench.workloads import default_data_dir

CATEGORIES = ("summarization", "rag", "translation", "qa", "math_reasoning", "mt_bench")


def load_questions(data_dir: Path, per_category: int) -> dict:
    """category -> first-turn questions (MT-bench's eight categories are pooled as ``mt_bench``).

    Raises:
        ValueError: the data file is missing.
    """
    path = data_dir / "spec_bench" / "question.jsonl"
    if not path.exists():
        raise ValueError(f"Spec-Bench questions not found at {str(path)!r}; pass --data-dir")
    out: dict = {c: [] for c in CATEGORIES}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        cat = row["category"] if row["category"] in out else "mt_bench"
        if len(out[cat]) < per_category:
            out[cat].append(row["turns"][0])
    return out


def run_config(engine_args: dict, prompts: list, max_tokens: int, batch: int, spec) -> dict:
    """Generate for ``prompts`` in batches of ``batch`` on a fresh engine; returns throughput and spec stats."""
    from kvserve import LLM, SamplingParams

    llm = LLM(**{**engine_args, "speculative_config": spec})
    engine = llm.llm_engine
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))  # warm-up
    engine.reset_stats()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.monotonic()
    n_out = 0
    for i in range(0, len(texts), batch):
        n_out += sum(len(o.outputs[0].token_ids) for o in llm.generate(texts[i : i + batch], sp))
    wall = time.monotonic() - start
    st = engine.stats.spec_decode
    return {
        "output_tokens": n_out, "wall_s": wall, "output_tokens_per_s": n_out / wall,
        "steps_per_token": engine.stats.num_steps / n_out,
        "acceptance_rate": st.acceptance_rate if st else None,
        "mean_accepted_length": st.mean_accepted_length if st else None,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.cli import engine_kwargs

    engine_args = {k: v for k, v in engine_kwargs(args).items() if k != "speculative_config"}
    questions = load_questions(Path(args.data_dir) if args.data_dir else default_data_dir(), args.per_category)
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    results = []
    print(f"{'category':<16}{'batch':>6}{'method':>8}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'acc len':>9}"
          f"{'steps/tok':>11}")
    for cat in [c.strip() for c in args.categories.split(",") if c.strip()]:
        if cat not in questions:
            raise ValueError(f"unknown category {cat!r}; choose from {CATEGORIES}")
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            base = run_config(engine_args, questions[cat], args.max_tokens, batch, None)
            spec = run_config(engine_args, questions[cat], args.max_tokens, batch, ngram)
            for name, r in (("none", base), ("ngram", spec)):
                r.update(category=cat, batch=batch, method=name,
                         speedup=r["output_tokens_per_s"] / base["output_tokens_per_s"])
                results.append(r)
                acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
                alen = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
                print(f"{cat:<16}{batch:>6}{name:>8}{r['output_tokens_per_s']:>8.1f}{r['speedup']:>9.2f}{acc:>8}"
                      f"{alen:>9}{r['steps_per_token']:>11.2f}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0
