"""``python -m benchmarks.spec``: speculative decoding on Spec-Bench (``../shared/data/spec_bench``), no speculation vs the
n-gram proposer vs the draft-model proposer (``--methods``, default all three), at batch 1 and batch 8, in one run.

Per category (summarization, rag, translation, qa, math_reasoning, mt_bench): the first turn of ``--per-category``
questions through the chat template, greedy, ``--max-tokens`` new tokens. Reported: wall-clock output tokens/s and
the speedup over no speculation, acceptance rate, mean accepted length (tokens per verification pass), target
forward passes (engine steps) per output token, for draft_model draft forward passes per output token, and the
speedup in process CPU time (less sensitive than wall clock to other jobs on a shared machine).
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


def make_llm(engine_args: dict, spec):
    """A fresh engine for one configuration, warmed up."""
    from kvserve import LLM, SamplingParams

    llm = LLM(**{**engine_args, "speculative_config": spec})
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))  # warm-up
    return llm


def run_config(llm, prompts: list, max_tokens: int, batch: int) -> dict:
    """Generate for ``prompts`` in batches of ``batch``; returns throughput and spec stats of this run."""
    from kvserve import SamplingParams

    engine = llm.llm_engine
    engine.kv_cache_manager.block_pool.reset_prefix_cache()  # every run prefills its prompts again
    engine.reset_stats()
    draft_passes_0 = getattr(engine.speculator and engine.speculator.proposer, "num_forward_passes", 0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start, cpu_start = time.monotonic(), time.process_time()
    n_out = 0
    for i in range(0, len(texts), batch):
        n_out += sum(len(o.outputs[0].token_ids) for o in llm.generate(texts[i : i + batch], sp))
    wall, cpu = time.monotonic() - start, time.process_time() - cpu_start
    st = engine.stats.spec_decode
    draft_passes = getattr(engine.speculator and engine.speculator.proposer, "num_forward_passes", None)
    return {
        "draft_passes_per_token": None if draft_passes is None else (draft_passes - draft_passes_0) / n_out,
        "output_tokens": n_out, "wall_s": wall, "output_tokens_per_s": n_out / wall,
        "cpu_s": cpu, "output_tokens_per_cpu_s": n_out / cpu,
        "steps_per_token": engine.stats.num_steps / n_out,
        "acceptance_rate": st.acceptance_rate if st else None,
        "mean_accepted_length": st.mean_accepted_length if st else None,
    }


def run_interleaved(engine_args: dict, configs: dict, prompts: list, max_tokens: int, batch: int,
                    repeats: int) -> dict:
    """Run every configuration ``repeats`` times, interleaved (A B C A B C ...), on one engine each; per
    configuration keep the run with the shortest wall time (the one least disturbed by other jobs on a shared
    machine; greedy runs do identical work every time)."""
    llms = {name: make_llm(engine_args, spec) for name, spec in configs.items()}
    best: dict = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            r = run_config(llm, prompts, max_tokens, batch)
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    return best


METHODS = ("none", "ngram", "draft_model")


def replay_passes(prompt_ids: list, output_ids: list, proposer, max_k: int = 64) -> int:
    """Target passes greedy speculation would need for a known greedy output, drafting up to ``max_k`` tokens a
    pass with ``proposer`` (a pass emits the matching draft prefix + one token). ``len(output_ids) / passes`` bounds
    the tokens per target pass — and so the speedup — of that proposer on that text, whatever verification costs."""
    passes = i = 0
    while i < len(output_ids):
        k = min(max_k, len(output_ids) - i - 1)
        draft = proposer.lookup(list(prompt_ids) + list(output_ids[:i]), k) if k > 0 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output_ids[i + accepted]:
            accepted += 1
        i += accepted + 1
        passes += 1
    return passes


def run_bound(args: argparse.Namespace, engine_args: dict, questions: dict, categories: list) -> int:
    """``--acceptance-bound``: per category, generate greedy without speculation, replay the outputs through the
    n-gram proposer with an unlimited draft length and print the bound on tokens per target pass."""
    from kvserve import SamplingParams
    from kvserve.spec_decode.ngram import NgramProposer

    llm = make_llm(engine_args, None)
    proposer = NgramProposer(1, 3)
    print(f"{'category':<16}{'questions':>10}{'tokens':>8}{'bound tokens/pass':>19}")
    for cat in categories:
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in questions[cat][: args.per_category]]
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        passes = sum(replay_passes(o.prompt_token_ids, o.outputs[0].token_ids, proposer) for o in outs)
        print(f"{cat:<16}{len(outs):>10}{tokens:>8}{tokens / passes:>19.2f}", flush=True)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-category", type=int, default=4,
                   help="questions per category (batch b uses max(this, b), so its batches are full)")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated configurations to run, of none, ngram, draft_model (default: all three)")
    p.add_argument("--draft-model", default=None,
                   help="draft_model: path of a separate draft model (default: early exit of the target)")
    p.add_argument("--draft-num-layers", type=int, default=None,
                   help="draft_model: layers of the early-exit draft (default: kvserve's DEFAULT_DRAFT_NUM_LAYERS)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per configuration, interleaved; the fastest is reported (noisy shared machines)")
    p.add_argument("--acceptance-bound", action="store_true",
                   help="instead: replay greedy outputs through the n-gram proposer (prompt_lookup 1..3, unlimited "
                        "draft length) and print the bound on tokens per target pass per category")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--output-json", default=None)


def spec_configs(args: argparse.Namespace) -> dict:
    """method name -> ``speculative_config`` (``None`` for no speculation), in the order of ``--methods``.

    Raises:
        ValueError: an unknown method name.
    """
    k = args.num_speculative_tokens
    draft = {"method": "draft_model", "num_speculative_tokens": k}
    if args.draft_model is not None:
        draft["model"] = args.draft_model
    if args.draft_num_layers is not None:
        draft["draft_num_layers"] = args.draft_num_layers
    known = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": k}, "draft_model": draft}
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in names if m not in known]
    if bad or not names:
        raise ValueError(f"--methods must list some of {METHODS}, got {args.methods!r}")
    return {m: known[m] for m in names}


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.arg_utils import engine_kwargs

    engine_args = {k: v for k, v in engine_kwargs(args).items() if k != "speculative_config"}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # a batch of b needs b questions: batch b runs the first max(--per-category, b) of each category
    questions = load_questions(Path(args.data_dir) if args.data_dir else default_data_dir(),
                               max([args.per_category] + batch_sizes))
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = [c for c in categories if c not in questions]
    if unknown:
        raise ValueError(f"unknown category {unknown[0]!r}; choose from {CATEGORIES}")
    if args.acceptance_bound:
        return run_bound(args, engine_args, questions, categories)
    configs = spec_configs(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    results = []
    print(f"{'category':<16}{'batch':>6}{'method':>12}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'acc len':>9}"
          f"{'steps/tok':>11}{'draft/tok':>11}{'cpu speedup':>13}")
    for cat in categories:
        for batch in batch_sizes:
            prompts = questions[cat][: max(args.per_category, batch)]
            runs = run_interleaved(engine_args, configs, prompts, args.max_tokens, batch, args.repeats)
            base = runs.get("none")
            for name, r in runs.items():
                r.update(category=cat, batch=batch, method=name,
                         speedup=r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None,
                         cpu_speedup=r["output_tokens_per_cpu_s"] / base["output_tokens_per_cpu_s"] if base else None)
                results.append(r)
                acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
                alen = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
                speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
                cpu_sp = "-" if r["cpu_speedup"] is None else f"{r['cpu_speedup']:.2f}"
                dpt = "-" if r["draft_passes_per_token"] is None else f"{r['draft_passes_per_token']:.2f}"
                print(f"{cat:<16}{batch:>6}{name:>12}{r['output_tokens_per_s']:>8.1f}{speedup:>9}{acc:>8}"
                      f"{alen:>9}{r['steps_per_token']:>11.2f}{dpt:>11}{cpu_sp:>13}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    from benchmarks import engine_main

    raise SystemExit(engine_main("spec", __doc__, add_args, run))
