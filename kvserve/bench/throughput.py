"""``kvserve bench throughput``: offline throughput of one workload under static and continuous batching (and,
with ``--compare transformers``, Hugging Face ``generate`` in static batches over the same weights), in one run.

All requests arrive at t=0 and use greedy sampling with ``ignore_eos`` and a fixed ``max_tokens``, so every
configuration generates exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve.bench.workloads import azure_trace, synthetic_skewed
from kvserve.metrics import percentile


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--dataset", choices=["synthetic", "azure"], default="synthetic",
                   help="synthetic: prompts 32-128 tokens, outputs 8-32 (75%%) or 128-256 (25%%); "
                        "azure: the Azure 2023 conv trace, token counts / --length-scale")
    p.add_argument("--length-scale", type=float, default=8.0, help="azure: divide token counts by this")
    p.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="continuous,static", help="comma-separated scheduling policies")
    p.add_argument("--compare", choices=["transformers"], default=None)
    p.add_argument("--output-json", default=None)
    p.set_defaults(max_num_seqs=16)


def run_engine(engine_args: dict, requests: list, policy: str) -> dict:
    """Run the workload on a fresh kvserve engine with scheduling ``policy``; returns its metrics."""
    from kvserve import LLM, SamplingParams

    llm = LLM(**{**engine_args, "scheduling": policy})
    llm.generate([list(range(1000, 1016))], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    llm.llm_engine.reset_stats()
    sps = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.monotonic()
    outs = llm.generate([r.prompt_token_ids for r in requests], sps, use_tqdm=True)
    wall = time.monotonic() - start
    stats = llm.llm_engine.stats
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "name": f"kvserve {policy}", "wall_s": wall, "steps": stats.num_steps, "output_tokens": n_out,
        "output_tokens_per_s": n_out / wall, "mean_ttft_s": statistics.fmean(ttft), "p99_ttft_s": percentile(ttft, 99),
        "mean_tpot_s": statistics.fmean(tpot) if tpot else None, "p99_tpot_s": percentile(tpot, 99),
        "mean_batch_size": stats.mean_batch_size, "preemptions": stats.num_preemptions,
        "peak_kv_blocks": stats.peak_used_blocks, "kv_waste": stats.kv_waste,
    }


def run_transformers(engine_args: dict, requests: list, batch_size: int) -> dict:
    """Hugging Face ``generate`` (greedy, KV cache, left padding) in static batches of ``batch_size``, FCFS; each
    batch runs to its longest output (``min_new_tokens`` forces the length); only requested tokens count."""
    import torch

    from kvserve.model.hf_reference import to_hf_model
    from kvserve.model.loader import load_model

    model = to_hf_model(load_model(engine_args.get("model"), engine_args.get("dtype") or "float32"))
    model.generate(torch.tensor([list(range(1000, 1016))]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    steps = 0
    start = time.monotonic()
    from tqdm.auto import tqdm

    for i in tqdm(range(0, len(requests), batch_size), desc="transformers batches"):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[j, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[j, width - n :] = 1
        n_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           pad_token_id=0)
        steps += n_new
    wall = time.monotonic() - start
    n_out = sum(r.output_len for r in requests)
    return {"name": "transformers static", "wall_s": wall, "steps": steps, "output_tokens": n_out,
            "output_tokens_per_s": n_out / wall}


def format_table(results: list) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [f"{'configuration':<22}{'wall s':>8}{'steps':>7}{'out tok/s':>11}{'TTFT mean/p99 ms':>19}"
             f"{'TPOT mean/p99 ms':>19}{'batch':>7}{'preempt':>8}"]
    for r in results:
        lines.append(
            f"{r['name']:<22}{r['wall_s']:>8.1f}{r['steps']:>7}{r['output_tokens_per_s']:>11.1f}"
            f"{ms(r.get('mean_ttft_s')) + '/' + ms(r.get('p99_ttft_s')):>19}"
            f"{ms(r.get('mean_tpot_s')) + '/' + ms(r.get('p99_tpot_s')):>19}"
            f"{r.get('mean_batch_size', 0):>7.1f}{r.get('preemptions', 0):>8}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.arg_utils import engine_kwargs

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "azure":
        requests = azure_trace(args.num_prompts, args.seed, args.data_dir, scale=args.length_scale)
    else:
        requests = synthetic_skewed(args.num_prompts, args.seed)
    engine_args = {k: v for k, v in engine_kwargs(args).items() if k != "scheduling"}
    results = [run_engine(engine_args, requests, p.strip()) for p in args.policies.split(",") if p.strip()]
    if args.compare == "transformers":
        results.append(run_transformers(engine_args, requests, args.max_num_seqs))
    by_name = {r["name"]: r for r in results}
    ratios = {}
    cont = by_name.get("kvserve continuous")
    if cont:
        for other in results:
            if other is not cont:
                ratios[f"continuous / {other['name']}"] = cont["output_tokens_per_s"] / other["output_tokens_per_s"]
    print()
    print(f"workload: {args.dataset}, {len(requests)} requests, prompt tokens "
          f"{sum(len(r.prompt_token_ids) for r in requests)}, output tokens {sum(r.output_len for r in requests)}, "
          f"max_num_seqs {args.max_num_seqs}")
    print(format_table(results))
    for k, v in ratios.items():
        print(f"{k:<40} {v:.2f}x output tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": ratios}, f, indent=2)
    return 0


