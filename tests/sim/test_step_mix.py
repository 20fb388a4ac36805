"""``kvserve.sim.step_mix`` (``kvserve sim validate --match-mix``) and the calibration's loaded phase."""

import time

import pytest

from kvserve.sim.cost_model import CostModel, ServerCalibrated, row_features
from kvserve.sim.step_mix import matched_weights, mix_key, nearest_key, predict_matched, step_kind

BASE = CostModel(0.004, {"prefill_tokens": 0.0015, "decode_tokens": 0.0018, "logit_rows": 0.0001,
                         "decode_ctx": 0.0025, "prefill_attn": 1.5, "rows": 0.0002})


class TwoRegimes:
    """A server whose steps of more than 4 rows run ``big`` times slower than the profile says, the rest
    ``small`` times: a shape the profile's linear model lacks."""

    def __init__(self, small=ServerCalibrated(BASE, 0.002, 1.0, 1.0), big=ServerCalibrated(BASE, 0.002, 1.5, 1.2)):
        self.small, self.big = small, big

    def step_time(self, f):
        return (self.big if f[5] > 4 else self.small).step_time(f)

    def __call__(self, so):
        from kvserve.sim.cost_model import step_features

        return self.step_time(step_features(so))


def steps_of(server, plans, t=10.0):
    """Back-to-back steps (``read_step_trace`` tuples) whose loop turns are ``server``'s time for each plan."""
    out = []
    for rows in plans:
        turn = server.step_time(row_features(rows))
        out.append((t, t + turn, True, rows))
        t += turn
    return out


def calibration_plans():
    """What a calibration runs: many 1- and 8-row decodes, lone prompts, then a few full batches."""
    plans = [[(1, 64 + k, 0, 1)] for k in range(40)] + [[(1, 64 + k, 0, 1)] * 8 for k in range(12)]
    plans += [[(n, 0, 0, 1)] for n in (48, 120, 192)]
    plans += [[(1, 90 + k, 0, 1)] * 16 for k in range(5)]
    plans += [[(96 + 8 * k, 0, 0, 1)] + [(1, 150 + k, 0, 1)] * 15 for k in range(5)]
    return plans


def test_step_kind_and_mix_key():
    assert step_kind([(1, 5, 0, 1)] * 3) == "decode" and step_kind([(4, 5, 1, 4)]) == "decode"  # a draft verify
    assert step_kind([(40, 0, 0, 1), (30, 0, 0, 0)]) == "prefill"
    assert step_kind([(40, 0, 0, 1), (1, 9, 0, 1)]) == "mixed"
    assert [mix_key([(1, 0, 0, 1)] * n)[1] for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    keys = [("decode", 0), ("decode", 3), ("mixed", 4), ("prefill", 0)]
    assert nearest_key(("decode", 4), keys) == ("decode", 3)
    assert nearest_key(("mixed", 3), keys) == ("mixed", 4)  # the same kind one power of two away
    assert nearest_key(("prefill", 1), keys) == ("prefill", 0)
    assert nearest_key(("decode", 2), [("decode", 1), ("decode", 3)]) == ("decode", 3)  # a tie: the larger


def test_matched_weights_give_each_class_its_share_of_the_levels_time():
    keys = [("decode", 0)] * 4 + [("decode", 3)] * 2 + [("prefill", 0)]
    level = {("decode", 3): 6.0, ("decode", 4): 2.0, ("prefill", 0): 2.0}  # no 1-row steps; 16 rows borrow 8's
    w = matched_weights(keys, level)
    assert w == pytest.approx([0.0] * 4 + [0.4, 0.4, 0.2])
    with pytest.raises(ValueError, match="needs calibration steps"):
        matched_weights(keys, {})


def test_weighted_fit_recovers_the_regime_it_is_weighted_to():
    """``fit_from_steps(weights=...)``: weight on the big steps alone gives back their numbers exactly; the plain
    fit of the same steps lies between the regimes."""
    from kvserve.sim.validate import fit_from_steps

    server = TwoRegimes()
    steps = steps_of(server, calibration_plans())
    big = [1.0 if len(rows) > 4 else 0.0 for *_, rows in steps]
    fit = fit_from_steps(steps, BASE, weights=big)
    assert fit["steps"] == 22 and fit["mean_abs_rel_err"] < 1e-9
    assert fit["offset_s"] == pytest.approx(0.002, rel=1e-6) and fit["scale"] == pytest.approx(1.5, rel=1e-6)
    assert fit["prefill_scale"] == pytest.approx(1.2, rel=1e-6)
    plain = fit_from_steps(steps, BASE)
    assert plain["steps"] == 65 and plain["mean_abs_rel_err"] > 0.05


def test_predict_matched_prices_an_overloaded_level_by_its_own_kind_of_steps():
    """An overloaded level of a two-regime server: replayed with the plain calibration its throughput is 7% too
    high and its latencies 6-10% too low (the calibration is mostly small steps); refitted to the level's simulated
    mix, each within 2%."""
    from kvserve.config import EngineConfig
    from kvserve.sim import trace as tr
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.validate import compare, fit_from_steps, replay

    server = TwoRegimes()
    config = EngineConfig.from_kwargs(max_num_seqs=16, block_size=16, max_num_batched_tokens=256)
    raw_sim = Simulator(config, BASE, 2048, max_model_len=4096)
    trace = [tr.TraceRequest(0.05 * k, 60 + 37 * k % 150, 20 + k % 5) for k in range(80)]
    real = Simulator(config, server, 2048, max_model_len=4096).run(trace).summary
    steps = steps_of(server, calibration_plans())
    plain_fit = fit_from_steps(steps, BASE)
    plain = compare(real, replay(raw_sim, plain_fit, trace, None))
    assert plain["output_throughput"][2] > 0.07 and plain["median_itl_ms"][2] < -0.09
    fit, summary, times = predict_matched(raw_sim, plain_fit, steps, trace, None)
    matched = compare(real, summary)
    assert all(abs(matched[k][2]) < 0.02 for k in matched)
    assert fit["scale"] > 1.5 > 1.4 > plain_fit["scale"]
    assert max(times, key=times.get) == "mixed/rows<=16" and sum(times.values()) > 0


def test_the_calibrations_loaded_phase_keeps_max_num_seqs_streams_busy(monkeypatch):
    """``calibrate(loaded_streams=16, loaded_rounds=3)``: 16 closed-loop sessions of 3 fresh prompts each (ids
    drawn fresh, lengths ``prefill_len // 4 .. prefill_len``), their starts staggered over one request's time at
    the measured 8-stream gap; the fit then covers those steps too."""
    import kvserve.sim.validate as V
    from kvserve.bench.serve import RequestResult

    seen = {}

    async def fake_run(url, model, reqs, offsets, **kw):
        if reqs[0].output_len == 2:
            return [RequestResult(success=True, ttft=0.3, itl=[])], 1.0
        g = 0.030 if len(reqs) == 1 else 0.060
        return [RequestResult(success=True, ttft=0.1, itl=[g] * 10) for _ in reqs], 1.0

    async def fake_sessions(url, model, sessions, offsets, **kw):
        seen["sessions"], seen["offsets"] = sessions, offsets
        return [], 1.0

    monkeypatch.setattr(V, "run_benchmark", fake_run)
    monkeypatch.setattr(V, "run_sessions", fake_sessions)
    monkeypatch.setattr(V, "read_idle_trace", lambda path: steps_of(TwoRegimes(), calibration_plans(),
                                                                     t=time.monotonic()))
    cal = V.calibrate("http://x", "m", BASE, step_trace_path="unused", loaded_streams=16, loaded_rounds=3,
                      prefill_len=192, output_len=24)
    assert cal["loaded"] == [16, 3] and cal["fit"] == "server steps" and cal["steps"] == 65
    sessions = seen["sessions"]
    assert len(sessions) == 16 and all(len(s) == 3 for s in sessions)
    prompts = [tuple(r.prompt) for s in sessions for r in s]
    assert len(set(prompts)) == 48 and all(48 <= len(p) <= 192 for p in prompts)
    assert all(r.output_len == 24 for s in sessions for r in s)
    assert seen["offsets"] == pytest.approx([i * 24 * 0.060 / 16 for i in range(16)])
    seen.clear()
    cal = V.calibrate("http://x", "m", BASE, step_trace_path="unused")
    assert "loaded" not in cal and not seen  # off by default


def test_match_mix_needs_the_calibrations_own_steps(tmp_path):
    import argparse

    import kvserve.sim.validate as V

    p = argparse.ArgumentParser()
    V.add_args(p)
    base = ["--model", "m.gguf", "--profile", str(tmp_path / "p.json"), "--warmup-s", "0", "--match-mix"]
    with pytest.raises(ValueError, match="--match-mix needs --save-calibration"):
        V.run(p.parse_args(base))
    with pytest.raises(ValueError, match="--match-mix needs the server's step trace: with --base-url, pass "
                                         "--step-trace FILE"):
        V.run(p.parse_args(base + ["--save-calibration", "--base-url", "http://x"]))
    with pytest.raises(ValueError, match="--calibration-loaded-rounds must be >= 0, got -1"):
        V.run(p.parse_args(base[:-1] + ["--calibration-loaded-rounds", "-1"]))
