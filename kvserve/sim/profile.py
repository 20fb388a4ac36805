"""``kvserve sim profile``: time real engine steps on this machine and save a cost-model profile (JSON).

The profile run drives a real ``LLMEngine`` through a fixed plan of workloads and records, for every step, the
step plan's features (``kvserve.sim.cost_model.step_features``, from the very ``SchedulerOutput`` the step ran)
and the wall time of ``engine.step()`` (scheduler + model runner + output processing):

- a 512-token shared prefix, prefilled in one chunk of the token budget;
- decode batches of 1, 4, 16 and 32 requests at contexts of about 32 and 512 tokens (the prompts share the prefix
  through the prefix cache, so setting up a batch costs little; the decode steps still read each request's whole
  context through its block table);
- unshared prompts of 128 and 512 tokens (prefill chunks from position 0), alone and beside 8 decodes;
- 128 and 512 new tokens after the cached prefix (a later round of a conversation: the same tokens as a fresh
  prompt, several times the attention pairs), alone and beside 8 decodes, so that the attention of long chunks is
  told apart from their matmuls.

About 110 steps: one to two minutes on an idle 2-core CPU, after the model has loaded and after ``warm_up``'s
throwaway steps (10 s by default). It takes far longer when the cores are shared; ``--num-threads 1`` is steadier
then, and the server being modelled should use the same setting. The fitted ``CostModel`` and the
raw samples are saved together with what identifies the measurement (model file, dtype, threads, KV bytes per
token, machine), so ``kvserve sim`` can refuse a profile of another model and the fit can be redone.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

from kvserve.sim.cost_model import FEATURES, CostModel, fit, fit_errors, step_features

logger = logging.getLogger(__name__)

# /2: prefill and decode tokens apart; /3: short chunks' pairs in decode_ctx; /4: every chunk's pairs in prefill_attn
PROFILE_FORMAT = "kvserve-sim-profile/4"
READABLE_FORMATS = ("kvserve-sim-profile/1", "kvserve-sim-profile/2", "kvserve-sim-profile/3", PROFILE_FORMAT)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (32, 512)
PREFILL_LENS = (128, 512)
WARMUP_S = 10.0  # unrecorded steps before the plan (``warm_up``)


def measure(engine_args: dict, quick: bool = False, warmup_s: float = WARMUP_S) -> dict:
    """Run the profiling plan on a fresh engine; returns the profile dict (see ``save``).

    Args:
        engine_args: engine arguments (``model``, ``dtype``, ``num_threads``, ``block_size``, ...); the pool,
            ``max_num_seqs`` and the token budget are set by the plan.
        quick: a smaller plan (for tests): batches 1, 4, contexts 32, 256, one prefill length.
        warmup_s: seconds of unrecorded steps before the plan (``warm_up``).
    """
    from kvserve import LLM, SamplingParams

    batches = (1, 4) if quick else DECODE_BATCHES
    contexts = (32, 256) if quick else DECODE_CONTEXTS
    prefills = (128,) if quick else PREFILL_LENS
    args = {**engine_args, "max_num_seqs": max(batches) + 8, "num_kv_blocks": engine_args.get("num_kv_blocks") or 1024,
            "enable_prefix_caching": True, "enable_chunked_prefill": True}
    args.setdefault("max_num_batched_tokens", 512)
    llm = LLM(**args)
    engine = llm.llm_engine
    samples: list = []
    captured: list = []
    real_schedule = engine.scheduler.schedule

    def schedule():
        so = real_schedule()
        captured.append(so)
        return so

    engine.scheduler.schedule = schedule  # an instance attribute on this private engine: the profile's probe
    ids = iter(range(10**9))

    def add(prompt: list, max_tokens: int) -> None:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           request_id=f"profile-{next(ids)}")

    def drain() -> None:
        while engine.has_unfinished_requests():
            captured.clear()
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if captured and captured[-1].scheduled:
                samples.append((step_features(captured[-1]), dt))

    warm_up(engine, add, warmup_s)
    base = [1000 + (i * 7919) % 28000 for i in range(max(contexts))]
    add(base, 1)
    drain()
    for c in contexts:
        for b in batches:
            for j in range(b):
                tail = [30000 + (next(ids) * 13 + k) % 15000 for k in range(8)]
                add(base[: c - 8] + tail, 8)
            drain()
            logger.info("profile: decode batch %d at context %d done (%d steps so far)", b, c, len(samples))
    cached = (len(base) - 1) // engine.block_size * engine.block_size  # whole blocks of the prefix: cache hits
    for after_prefix in (False, True):
        for n in prefills:
            for with_decodes in (0, 8):
                for j in range(with_decodes):
                    add(base[:24] + [30000 + (next(ids) * 13 + k) % 15000 for k in range(8)], 6)
                fresh = [1000 + (next(ids) * 31 + k) % 28000 for k in range(n)]
                add(base[:cached] + fresh if after_prefix else fresh, 2)
                drain()
    model = fit(samples)
    mc = engine.config.model_config
    profile = {
        "format": PROFILE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": Path(str(engine.model_path)).name,
        "dtype": mc.dtype,
        "num_threads": mc.num_threads,
        "torch_threads": __import__("torch").get_num_threads(),
        "kv_cache_dtype": engine.limits.kv_cache_dtype,
        "kv_bytes_per_token": engine.model.bytes_per_block(1, engine.kv_cache_dtype),
        # the pool `kvserve serve` with these flags gets on this machine (the plan's own engine has a fixed one): the
        # simulator's default, so that a replay elsewhere does not size its pool from that other machine's free RAM
        "kv_cache_memory_bytes": serve_pool_bytes(engine_args, engine),
        "max_position_embeddings": engine.arch.max_position_embeddings,
        "quantization": mc.effective_quantization,
        "machine": machine_label(),
        "features": list(FEATURES),
        "cost_model": model.to_dict(),
        "fit": fit_errors(model, samples),
        "samples": [{"features": list(f), "step_s": t} for f, t in samples],
    }
    return profile


def machine_label() -> dict:
    """What the profile was measured on: the CPU model (``/proc/cpuinfo``'s ``model name``; ``None`` where there is
    none), logical CPUs, platform, and the kvserve commit (``git rev-parse HEAD`` of the source tree; ``None``
    outside a git checkout): a profile is only valid for that machine and that code."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": cpu or platform.processor() or None, "cpus": os.cpu_count(),
            "platform": platform.platform(), "kvserve_commit": _source_commit()}


def _source_commit():
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def check_warmup_s(seconds: float) -> float:
    """``--warmup-s`` as given, checked (``kvserve sim profile``).

    Raises:
        ValueError: not a finite number of seconds >= 0 (``inf`` would never end the warm-up).
    """
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"--warmup-s must be a finite number of seconds >= 0, got {seconds}")
    return seconds


def warm_up(engine, add, seconds: float) -> int:
    """Step ``engine`` on throwaway requests (4 fresh 64-token prompts, 16 tokens each, again and again) for at
    least ``seconds`` (at least one round), recording nothing; returns the steps run. The first seconds of a fresh
    process can run far slower than the rest: in one profile on a 2-vCPU Xeon its first 16 steps, batch-1 decodes
    among them, took 16-62 ms where the same steps later took 18-19 ms, and fitted with the rest they raised the
    intercept from 13.4 to 20.2 ms and the mean fit error from 7.6% to 17% (docs/simulator.md, "Without steal, the
    host's speed still moves"). The prompts share no block with the plan's."""
    steps, t_end, w = 0, time.monotonic() + seconds, 0
    while True:
        for _ in range(4):
            add([1000 + (w * 104729 + k * 7) % 28000 for k in range(64)], 16)
            w += 1
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if time.monotonic() >= t_end:
            return steps


def serve_pool_bytes(engine_args: dict, engine) -> int:
    """Bytes of the KV pool an engine with ``engine_args`` would get on this machine now (its ``num_kv_blocks`` or
    ``kv_cache_memory_bytes``, else the default share of free RAM, measured with ``engine``'s model loaded, as a
    server measures it), in whole blocks of ``engine``'s layout."""
    from kvserve.config import EngineConfig

    cc = EngineConfig.from_kwargs(**{k: v for k, v in engine_args.items() if k != "device"}).cache_config
    per_block = engine.model.bytes_per_block(cc.block_size, engine.kv_cache_dtype)
    return cc.resolve_num_blocks(per_block) * per_block


def save(profile: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)


def load(path, model_name: str | None = None) -> tuple[dict, CostModel]:
    """Read a profile; with ``model_name``, check it was measured on that model file.

    Returns ``(profile dict, cost model)``.

    Raises:
        ValueError: missing file, not a profile, a malformed cost model, or a profile of another model.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"profile not found: {str(p)!r} (make one with `kvserve sim profile --output {p}`)")
    try:
        prof = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(prof, dict) or prof.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{p}: not a kvserve sim profile (field 'format' must be one of {list(READABLE_FORMATS)})")
    for key in ("model", "kv_bytes_per_token", "max_position_embeddings", "cost_model"):
        if key not in prof:
            raise ValueError(f"{p}: missing field {key!r}")
    if model_name is not None and prof["model"] != model_name:
        raise ValueError(f"{p}: profile field 'model' is {prof['model']!r}, measured on another model than "
                         f"{model_name!r}; profile this model with `kvserve sim profile --model ...`")
    kv_mem = prof.get("kv_cache_memory_bytes")
    if kv_mem is not None and (isinstance(kv_mem, bool) or not isinstance(kv_mem, int) or kv_mem < 1):
        raise ValueError(f"{p}: field 'kv_cache_memory_bytes' must be an integer >= 1, got {kv_mem!r}")
    cost = CostModel.from_dict(prof["cost_model"], str(p))
    if "server_calibration" in prof:
        logger.warning("%s: field 'server_calibration' is no longer applied (the simulator replays the profiled "
                       "engine's step costs); the field is ignored", p)
    return prof, cost


def refit(profile: dict) -> CostModel:
    """Fit the cost model again from the profile's raw samples.

    Raises:
        ValueError: the samples have other features than ``FEATURES`` (a profile of the first format).
    """
    if profile.get("features") != list(FEATURES):
        raise ValueError(f"profile features {profile.get('features')} are not {list(FEATURES)}; measure it again")
    return fit([(tuple(s["features"]), s["step_s"]) for s in profile["samples"]])
