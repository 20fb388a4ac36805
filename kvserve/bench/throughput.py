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
    p.add_argument("--step-costs", action="store_true",
                   help="also time one decode step at batch 1, 2, 4, ... max_num_seqs (where batching stops paying)")
    p.add_argument("--profile-step", action="store_true",
                   help="also break a batch-1 and a batch-32 decode step down by component (weights vs the rest)")
    p.set_defaults(max_num_seqs=16)


def percentile(values: list, q: float) -> float:
    """``q``-th percentile (0..100) with linear interpolation; 0.0 for an empty list."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


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


def step_costs(engine_args: dict, max_batch: int, context: int = 128, repeats: int = 9) -> list:
    """Median wall time of one decode step at batch sizes 1, 2, 4, ... ``max_batch`` (each request at ~``context``
    tokens of context), on a fresh engine. Returns ``[{"batch", "step_ms", "ms_per_token"}]``.

    While ``step_ms`` stays flat the step is bound by reading the weights, and extra requests ride along almost
    free; once it grows linearly the step is compute-bound and batching no longer raises throughput.
    """
    from kvserve import LLM

    llm = LLM(**{**engine_args, "max_num_seqs": max_batch})
    engine = llm.llm_engine
    out, b = [], 1
    while b <= max_batch:
        _prefill_batch(engine, b, context, repeats + 4, "step-cost")
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
        step_ms = 1000 * statistics.median(times)
        out.append({"batch": b, "step_ms": step_ms, "ms_per_token": step_ms / b})
        b *= 2
    return out


class _Timed:
    """Wraps a callable, adding its wall time to ``totals[key]`` (every other attribute passes through)."""

    def __init__(self, fn, key: str, totals: dict):
        self._fn, self._key, self._totals = fn, key, totals

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._totals[self._key] = self._totals.get(self._key, 0.0) + time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._fn, name)


#: Components of ``step_profile``, in table order; everything but ``weights`` is the step's overhead.
PROFILE_ROWS = ("weights", "attention", "norms+activation", "rope", "embedding", "forward other", "sampler",
                "runner other", "scheduler", "outputs+detokenize", "engine other")


def step_profile(engine_args: dict, batches=(1, 32), context: int = 128, repeats: int = 9) -> list:
    """Where one decode step's time goes, at each batch size in ``batches`` (each request at ~``context`` tokens):
    every linear layer (``weights``: reading and multiplying weights) and every other part of ``LLMEngine.step``
    wrapped in a wall-clock timer (~1 us per wrapped call, ~150 calls per step). When the model runs its layer
    loop in C (``LlamaModel.fused_layers``), the loop times its own matmuls, attention and element-wise kernels
    (``FusedLayerLoop.timings``) into the same rows. Returns ``[{"batch", "step_ms", "components": {name: ms per
    step}}]``, names from ``PROFILE_ROWS``."""
    import torch

    from kvserve import LLM

    llm = LLM(**{**engine_args, "max_num_seqs": max(batches)})
    engine = llm.llm_engine
    model, runner, tot = engine.model, engine.model_runner, {}
    fused = getattr(model, "fused_layers", None)
    if fused is not None:
        fused.timings = torch.zeros(3, dtype=torch.int64)
    for layer in model.layers:
        for k in ("qkv", "o", "gate_up", "down"):
            layer[k] = _Timed(layer[k], "weights", tot)
    model.lm_head = _Timed(model.lm_head, "weights", tot)
    for name in ("build_metadata", "forward_qkv"):  # forward_qkv: RoPE on q/k, K/V write, attention
        setattr(model.attn, name, _Timed(getattr(model.attn, name), "attention", tot))
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):  # add_rms_norm: the residual adds too
        setattr(model.ops, name, _Timed(getattr(model.ops, name), "norms+activation", tot))
    model._rope = _Timed(model._rope, "rope", tot)
    model.embed = _Timed(model.embed, "embedding", tot)
    model.forward = _Timed(model.forward, "forward", tot)
    runner.sampler = _Timed(runner.sampler, "sampler", tot)
    runner.execute_model = _Timed(runner.execute_model, "runner", tot)
    for name in ("schedule", "update_from_output"):
        setattr(engine.scheduler, name, _Timed(getattr(engine.scheduler, name), "scheduler", tot))
    for name in ("update_text", "make_outputs"):
        setattr(engine.output_processor, name, _Timed(getattr(engine.output_processor, name), "outputs+detokenize",
                                                      tot))
    out = []
    for b in batches:
        _prefill_batch(engine, b, context, repeats + 4, "profile")
        engine.step()  # the first decode step after the prompts: warm
        tot.clear()
        if fused is not None:
            fused.timings.zero_()
        t = time.perf_counter()
        for _ in range(repeats):
            engine.step()
        step = (time.perf_counter() - t) / repeats
        if fused is not None:  # the C loop's own clock: matmuls, attention, element-wise
            for k, ns in zip(("weights", "attention", "norms+activation"), fused.timings.tolist()):
                tot[k] = tot.get(k, 0.0) + ns / 1e9
        c = {k: v / repeats for k, v in tot.items()}
        while engine.has_unfinished_requests():
            engine.step()
        inner = sum(c.get(k, 0.0) for k in ("weights", "attention", "norms+activation", "rope", "embedding"))
        c["forward other"] = c.pop("forward", 0.0) - inner
        c["runner other"] = c.pop("runner", 0.0) - c["forward other"] - inner - c.get("sampler", 0.0)
        c["engine other"] = step - sum(c.values())
        out.append({"batch": b, "step_ms": 1000 * step, "components": {k: 1000 * c.get(k, 0.0) for k in PROFILE_ROWS}})
    return out


def format_profile(profiles: list) -> str:
    """``step_profile``'s result as a table: component, then ms and % of the step per batch size."""
    head = "".join(f"{'b=' + str(p['batch']) + ' ms':>12}{'%':>7}" for p in profiles)
    lines = [f"{'component':<20}{head}"]
    for k in PROFILE_ROWS + ("overhead (not weights)", "step"):
        row = f"{k:<20}"
        for p in profiles:
            c = p["components"]
            v = {"step": p["step_ms"], "overhead (not weights)": p["step_ms"] - c["weights"]}.get(k, c.get(k))
            row += f"{v:>12.2f}{100 * v / p['step_ms']:>6.1f}%"
        lines.append(row)
    return "\n".join(lines)


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
    costs = step_costs(engine_args, args.max_num_seqs) if args.step_costs else []
    if costs:
        print("decode step cost: " + ", ".join(f"b={c['batch']} {c['step_ms']:.0f} ms ({c['ms_per_token']:.1f}/token)"
                                               for c in costs))
    profile = step_profile(engine_args) if args.profile_step else []
    if profile:
        print(format_profile(profile))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": ratios, "step_costs": costs,
                       "step_profile": profile}, f, indent=2)
    return 0


def _prefill_batch(engine, b: int, context: int, max_tokens: int, tag: str) -> None:
    """Add ``b`` greedy requests of ``context`` distinct prompt tokens (EOS ignored) and step until every prompt is
    computed, so the next step is a pure batch-``b`` decode that lasts at least ``max_tokens`` more steps.

    Under chunked prefill the first requests decode while the later prompts are still being computed, so each
    request gets ``max_tokens`` plus the number of steps the prefill takes (else the early ones would finish inside
    the measured steps and the batch would be smaller than ``b``).

    Raises:
        RuntimeError: fewer than ``b`` requests are running once the prompts are computed (a pool or
            ``max_num_seqs`` too small for the batch).
    """
    from kvserve import SamplingParams

    budget = engine.config.scheduler_config.max_num_batched_tokens
    sp = SamplingParams(temperature=0, max_tokens=max_tokens + -(-b * context // budget) + 2, ignore_eos=True)
    for i in range(b):
        engine.add_request(list(range(1000 + i, 1000 + i + context)), sp, request_id=f"{tag}-{b}-{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    if len(engine.scheduler.running) != b:
        raise RuntimeError(f"{tag}: {len(engine.scheduler.running)} of {b} requests running after their prompts")