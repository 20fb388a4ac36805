"""Where a decode step's time goes: ``python -m benchmarks.step_profile [--step-costs] [--profile-step]``.

- ``--step-costs``: the median wall time of one decode step at batch 1, 2, 4, ... ``max_num_seqs`` (each request at
  ~128 tokens of context): while it stays flat the step is bound by reading the weights and extra requests ride
  along almost free; once it grows linearly batching no longer raises throughput.
- ``--profile-step``: decode steps at ``--batches`` (default 1 and 64) broken down by component (weights vs the
  rest); the last row sums the Python around the kernels (forward, runner and engine other).

Used by ``benchmarks.roofline`` too; results in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time


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
        prefill_batch(engine, b, context, repeats + 4, "step-cost")
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
        for k in ("qkv", "o", "gate_up", "down", "moe"):  # (a MoE layer: its whole MLP, the router included)
            if layer.get(k) is not None:
                layer[k] = _Timed(layer[k], "weights", tot)
    model.lm_head = _Timed(model.lm_head, "weights", tot)
    for name in ("build_metadata", "forward_qkv"):  # forward_qkv: RoPE on q/k, K/V write, attention
        setattr(model.attn, name, _Timed(getattr(model.attn, name), "attention", tot))
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):  # add_rms_norm: the residual adds too
        setattr(model.ops, name, _Timed(getattr(model.ops, name), "norms+activation", tot))
    model.ropes = _Timed(model.ropes, "rope", tot)
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
        prefill_batch(engine, b, context, repeats + 4, "profile")
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


#: The rows of ``step_profile`` that are Python around the kernels (what no timed kernel call covers).
PYTHON_ROWS = ("forward other", "runner other", "engine other")


def format_profile(profiles: list) -> str:
    """``step_profile``'s result as a table: component, then ms and % of the step per batch size."""
    head = "".join(f"{'b=' + str(p['batch']) + ' ms':>12}{'%':>7}" for p in profiles)
    lines = [f"{'component':<20}{head}"]
    for k in PROFILE_ROWS + ("Python (other rows)", "overhead (not weights)", "step"):
        row = f"{k:<20}"
        for p in profiles:
            c = p["components"]
            v = {"step": p["step_ms"], "overhead (not weights)": p["step_ms"] - c["weights"],
                 "Python (other rows)": sum(c[x] for x in PYTHON_ROWS)}.get(k, c.get(k))
            row += f"{v:>12.2f}{100 * v / p['step_ms']:>6.1f}%"
        lines.append(row)
    return "\n".join(lines)


def prefill_batch(engine, b: int, context: int, max_tokens: int, tag: str) -> None:
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


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-costs", action="store_true",
                   help="time one decode step at batch 1, 2, 4, ... max_num_seqs (where batching stops paying)")
    p.add_argument("--profile-step", action="store_true",
                   help="break decode steps at --batches down by component (weights vs the rest)")
    p.add_argument("--batches", default="1,64", help="--profile-step: comma-separated batch sizes")
    p.add_argument("--context", type=int, default=128, help="--profile-step: tokens of context per request")
    p.add_argument("--repeats", type=int, default=9, help="--profile-step: steps timed per batch size")
    p.set_defaults(max_num_seqs=32)


def run(args: argparse.Namespace, engine_args: dict) -> int:
    if not (args.step_costs or args.profile_step):
        raise ValueError("choose --step-costs and/or --profile-step")
    if args.step_costs:
        costs = step_costs(engine_args, args.max_num_seqs)
        print("decode step cost: " + ", ".join(f"b={c['batch']} {c['step_ms']:.0f} ms ({c['ms_per_token']:.1f}/token)"
                                               for c in costs))
    if args.profile_step:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
        if not batches or min(batches) < 1 or args.context < 1 or args.repeats < 1:
            raise ValueError("--batches must list sizes >= 1; --context and --repeats must be >= 1")
        print(format_profile(step_profile(engine_args, batches, args.context, args.repeats)))
    return 0


if __name__ == "__main__":
    from benchmarks import engine_main

    raise SystemExit(engine_main("step_profile", __doc__, add_args, run, pass_engine_kwargs=True))
