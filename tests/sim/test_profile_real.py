"""``kvserve sim profile --quick`` on the real model: every recorded step carries the features of the plan it ran,
the fit is non-negative, and ``kvserve sim`` replays with the profile."""

import pytest
import json
import re

from kvserve.entrypoints.cli import main
from kvserve.sim.cost_model import FEATURES

pytestmark = pytest.mark.real_model


def test_quick_profile_then_simulate(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["sim", "profile", "--quick", "--num-threads", "1", "--output", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["features"] == list(FEATURES) and prof["model"].endswith(".gguf")
    # SmolLM2-135M, a bfloat16 cache ("auto" on quantized weights): 30 layers, 3 KV heads of 64, 2 bytes
    assert prof["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert prof["kv_cache_dtype"] == "bfloat16"  # what the step costs were measured over (sim refuses another)
    from kvserve.config import EngineConfig

    per_block = prof["kv_bytes_per_token"] * 16  # the pool `serve` would get here, in whole blocks (block_size 16)
    expect = EngineConfig.from_kwargs().cache_config.resolve_num_blocks(per_block) * per_block
    assert prof["kv_cache_memory_bytes"] % per_block == 0
    assert abs(prof["kv_cache_memory_bytes"] - expect) <= 0.25 * expect  # free RAM moves a little between the two
    assert len(prof["samples"]) >= 20
    f = {name: i for i, name in enumerate(FEATURES)}
    decodes = [s["step_s"] for s in prof["samples"]  # 4 single-token rows and no prompt chunk
               if s["features"][f["decode_tokens"]] == s["features"][f["rows"]] == 4
               and s["features"][f["prefill_tokens"]] == 0]
    assert decodes and all(t > 0 for t in decodes)
    # the 128-token prompt both fresh and after the cached prefix (240 tokens of 256: whole 16-token blocks), so
    # the fit can tell SDPA's pairs from the chunk's matmuls
    attn = sorted(s["features"][f["prefill_attn"]] for s in prof["samples"]
                  if s["features"][f["prefill_tokens"]] == 128 and s["features"][f["rows"]] == 1)
    assert attn == [128 * 64.5 / 1e6, 128 * (240 + 64.5) / 1e6]
    cm = prof["cost_model"]
    assert cm["intercept_s"] >= 0 and all(v >= 0 for v in cm["coef_s"].values())
    assert prof["fit"]["mean_abs_rel_err"] >= 0  # its quality depends on the host's noise: docs/simulator.md
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i, "prompt_tokens": 30, "output_tokens": 5}) + "\n"
                             for i in range(5)))
    capsys.readouterr()
    assert main(["sim", "--profile", str(out), "--dataset", "jsonl", "--trace-file", str(trace),
                 "--num-kv-blocks", "64"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"successful requests\s+5\n", text) and re.search(r"failed requests\s+0\n", text)
    assert ", KV cache bfloat16) in " in text  # the header names the cache type "auto" replays (the profile's)


def test_warm_up_runs_rounds_of_fresh_throwaway_requests_until_its_time_is_up():
    """``kvserve.sim.profile.warm_up``: rounds of 4 fresh 64-token prompts of 16 tokens, stepped to the end, until
    ``seconds`` have passed (``0``: one round); no prompt repeats or shares a block with the plan's prefix."""
    import time

    from kvserve.sim.profile import warm_up

    class Engine:  # each request takes ``max_tokens`` steps; a step sleeps 1 ms
        def __init__(self):
            self.left = []

        def has_unfinished_requests(self):
            return any(self.left)

        def step(self):
            time.sleep(0.001)
            self.left = [n - 1 for n in self.left if n > 1]

    engine, added = Engine(), []

    def add(prompt, max_tokens):
        added.append((tuple(prompt), max_tokens))
        engine.left.append(max_tokens)

    assert warm_up(engine, add, 0.0) == 16 and len(added) == 4
    added.clear()
    steps = warm_up(engine, add, 0.1)
    assert steps == 16 * len(added) // 4 and len(added) >= 8
    assert all(len(p) == 64 and n == 16 for p, n in added) and len({p for p, _ in added}) == len(added)
    plan_prefix = tuple(1000 + (i * 7919) % 28000 for i in range(16))  # the plan's first block (``measure``)
    assert all(p[:16] != plan_prefix for p, _ in added)


def test_negative_or_endless_warm_up_is_refused(capsys):
    for bad, shown in (("-1", "-1.0"), ("inf", "inf"), ("nan", "nan")):  # inf would never end
        assert main(["sim", "profile", "--warmup-s", bad, "--output", "/nonexistent/p.json"]) == 2
        assert f"error: --warmup-s must be a finite number of seconds >= 0, got {shown}" in capsys.readouterr().err
