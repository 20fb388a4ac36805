"""Pieces of ``kvserve sim validate`` that need no server: the level slice, the flags, the comparison, and the
server calibration applied from a profile."""

import argparse
import json
from pathlib import Path

import pytest

from kvserve.sim.cost_model import FEATURES, ServerCalibrated, decode_features, prefill_features
from kvserve.sim.profile import PROFILE_FORMAT, load
from kvserve.sim.validate import _engine_flags, compare, level_requests

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_engine_flags_round_trip_through_the_cli_parser():
    flags = _engine_flags({"max_num_seqs": 4, "enable_chunked_prefill": False, "num_kv_blocks": None,
                           "enable_prefix_caching": True})
    assert flags == ["--max-num-seqs", "4", "--no-enable-chunked-prefill", "--enable-prefix-caching"]
    from kvserve.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(flags))
    assert kw["max_num_seqs"] == 4 and kw["enable_chunked_prefill"] is False


def test_compare_relative_errors():
    c = compare({"output_throughput": 10.0, "median_ttft_ms": 200.0}, {"output_throughput": 11.0,
                                                                        "median_ttft_ms": 150.0})
    assert c["output_throughput"] == (10.0, 11.0, pytest.approx(0.1))
    assert c["median_ttft_ms"] == (200.0, 150.0, pytest.approx(-0.25))
    assert c["p99_tpot_ms"] == (None, None, None)


def test_server_calibration_is_applied_from_the_profile(tmp_path):
    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "kv_bytes_per_token": 1, "max_position_embeddings": 8,
            "cost_model": {"intercept_s": 0.1, "coef_s": {**{f: 0.0 for f in FEATURES}, "tokens": 0.01}},
            "server_calibration": {"offset_s": 0.005, "scale": 2.0}}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    _, cost = load(p)
    assert isinstance(cost, ServerCalibrated)
    assert cost.step_time(decode_features(4, 10)) == pytest.approx(0.005 + 2 * (0.1 + 0.04))
    _, raw = load(p, server_calibration=False)
    assert raw.step_time(decode_features(4, 10)) == pytest.approx(0.14)
    # prefill calibrated apart: only the prompt-chunk terms take prefill_scale
    prof["server_calibration"]["prefill_scale"] = 3.0
    p.write_text(json.dumps(prof))
    _, cost = load(p)
    assert cost.step_time(decode_features(4, 10)) == pytest.approx(0.005 + 2 * (0.1 + 0.04))
    assert cost.step_time(prefill_features(100)) == pytest.approx(0.005 + 2 * (0.1 + 0.0) + 3 * (100 * 0.01))
    assert cost.contention is None
    # a calibration on a data-parallel deployment carries its contention factors
    prof["server_calibration"]["contention"] = [1.0, 1.8]
    p.write_text(json.dumps(prof))
    assert load(p)[1].contention == [1.0, 1.8] and load(p)[1].prefill_contention is None
    prof["server_calibration"]["prefill_contention"] = [1.0, 1.1]
    p.write_text(json.dumps(prof))
    assert load(p)[1].prefill_contention == [1.0, 1.1]
    prof["server_calibration"]["prefill_contention"] = [1.0]
    p.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match="prefill_contention needs as many factors as contention"):
        load(p)
    del prof["server_calibration"]["prefill_contention"]
    prof["server_calibration"]["contention"] = [1.0, -1]
    p.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match=r"'server_calibration': contention\[1\] .* must be a finite number > 0"):
        load(p)
    del prof["server_calibration"]["contention"]
    prof["server_calibration"]["scale"] = 0
    p.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match="server_calibration.scale' must be > 0"):
        load(p)


@pytest.mark.skipif(not (DATA / "azure_llm_2023").exists(), reason="needs ../shared/data")
def test_level_slice_has_the_levels_mean_rate_and_fresh_prompts():
    args = argparse.Namespace(num_prompts=11, data_dir=None, azure_kind="conv", length_scale=8.0, max_input_len=256,
                              max_output_len=24)
    a = level_requests(args, 0.5, 100)
    assert a[0].arrival_s == 0.0 and a[-1].arrival_s == pytest.approx(10 / 0.5)
    b = level_requests(args, 0.5, 101)
    assert a[0].prompt != b[0].prompt  # another seed: other prompts, no prefix-cache carry-over between levels


def test_calibration_of_a_data_parallel_deployment_predicts_per_replica_rows(monkeypatch):
    """``calibrate(replicas=2)``: 8 concurrent streams on 2 replicas are predicted as steps of 4 rows each (the
    measured gaps are fed in; no server)."""
    import kvserve.sim.validate as V
    from kvserve.bench.serve import RequestResult

    class Linear:  # step = 10 ms + 5 ms per decode row; a prefill of n tokens: 1 ms per token
        def step_time(self, f):  # f: FEATURES (prefill tokens, decode tokens, ...)
            return 0.010 + 0.005 * f[1] + 0.001 * f[0]

        def prefill_time(self, f):
            return 0.001 * f[0]

    # the server: twice the model, 30 ms at 1 stream, (10 + 5 * 4) * 2 at 8 on 2 replicas; 2 streams (one per
    # replica) as fast as one: no contention
    gaps = {1: 0.030, 2: 0.030, 8: 0.060}

    async def fake_run(url, model, reqs, offsets, **kw):
        g = gaps[len(reqs)]
        return [RequestResult(success=True, ttft=0.25, itl=[g] * 10) for _ in reqs], 1.0

    monkeypatch.setattr(V, "run_benchmark", fake_run)
    cal = V.calibrate("http://x", "m", Linear(), replicas=2)
    assert [(b, round(p, 6)) for b, _, p in cal["points"]] == [(1, 0.015), (8, 0.030)]
    assert cal["scale"] == pytest.approx(2.0) and cal["offset_s"] == pytest.approx(0.0)
    assert cal["contention"] == [1.0, 1.0]
    one = V.calibrate("http://x", "m", Linear())
    assert [round(p, 6) for _, _, p in one["points"]] == [0.015, 0.05] and "contention" not in one
    # each step 1.5x slower while both replicas compute: 2 streams 45 ms, 8 streams 90 ms. The factor is measured
    # and taken out of the 8-stream point, so scale and offset stay those of one replica alone
    gaps.update({2: 0.045, 8: 0.090})
    cal = V.calibrate("http://x", "m", Linear(), replicas=2)
    assert cal["contention"] == pytest.approx([1.0, 1.5])
    assert cal["scale"] == pytest.approx(2.0) and cal["offset_s"] == pytest.approx(0.0)
    gaps[2] = 0.025  # faster with two busy is noise: the factor is 1
    assert V.calibrate("http://x", "m", Linear(), replicas=2)["contention"] == [1.0, 1.0]


def test_calibration_runs_pool_the_decode_gaps_and_take_the_median_prefill(monkeypatch):
    """``decode_runs`` repeats each decode batch and pools its gaps; ``prefill_runs`` lone prefills give the median
    TTFT; fewer than one run is a ``ValueError`` naming both counts."""
    import kvserve.sim.validate as V
    from kvserve.bench.serve import RequestResult

    class Linear:
        def step_time(self, f):
            return 0.010 + 0.005 * f[1] + 0.001 * f[0]

        def prefill_time(self, f):
            return 0.001 * f[0]

    calls = {"decode": 0, "prefill": []}
    ttfts = iter([0.5, 0.2, 0.3, 0.25, 0.9])  # the lone prefills, in order: median 0.3

    async def fake_run(url, model, reqs, offsets, **kw):
        if reqs[0].output_len == 2:  # a lone prefill
            t = next(ttfts)
            calls["prefill"].append(t)
            return [RequestResult(success=True, ttft=t, itl=[])], 1.0
        calls["decode"] += 1
        g = 0.030 if len(reqs) == 1 else 0.060
        return [RequestResult(success=True, ttft=0.1, itl=[g] * 10) for _ in reqs], 1.0

    monkeypatch.setattr(V, "run_benchmark", fake_run)
    cal = V.calibrate("http://x", "m", Linear(), prefill_runs=5, decode_runs=2)
    assert calls["decode"] == 4 and calls["prefill"] == [0.5, 0.2, 0.3, 0.25, 0.9]
    assert cal["prefill_points"][0][1] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="prefill_runs=0, decode_runs=1"):
        V.calibrate("http://x", "m", Linear(), prefill_runs=0)


def _synthetic_trace(server):
    """A step trace as ``kvserve.sim.trace.read_step_trace`` gives it, whose loop turns are exactly ``server``'s
    prediction for each plan: decodes of 1-12 rows, lone prompts and prompt chunks beside decodes."""
    from kvserve.sim.cost_model import row_features

    plans = [[(1, 100 + k, 0, 1)] * b for k, b in enumerate((1, 2, 4, 8, 12))]
    plans += [[(n, 0, 0, 1)] for n in (48, 128, 256)]
    plans += [[(128, 0, 0, 1)] + [(1, 300, 0, 1)] * 6, [(200, 64, 0, 0), (1, 80, 0, 1)]]
    steps, t = [], 10.0
    for k, rows in enumerate(plans):
        turn = server.step_time(row_features(rows))
        more = k not in (4, len(plans) - 1)  # the loop idles after the fifth step, and ends after the last
        steps.append((t, t + 0.9 * turn if more else t + turn, more, rows))
        t += turn + (0.0 if more else 2.0)
    return steps


def test_fit_from_steps_recovers_the_server_calibration():
    """``fit_from_steps``: the loop turns of a server that runs ``offset + scale x decode part + prefill_scale x
    prefill part`` give back those three numbers; ``loop_turns`` counts an idle wait in no step."""
    from kvserve.sim.cost_model import CostModel
    from kvserve.sim.validate import fit_from_steps, loop_turns

    base = CostModel(0.004, {"prefill_tokens": 0.0015, "decode_tokens": 0.0018, "logit_rows": 0.0001,
                             "decode_ctx": 0.0025, "prefill_attn": 1.5, "rows": 0.0002})
    server = ServerCalibrated(base, offset_s=0.002, scale=1.3, prefill_scale=1.1)
    steps = _synthetic_trace(server)
    turns = loop_turns(steps)
    assert turns[4][0] == pytest.approx(steps[4][1] - steps[4][0])  # idle after it: the step alone
    assert turns[0][0] == pytest.approx(steps[1][0] - steps[0][0])
    fit = fit_from_steps(steps, base)
    assert fit["offset_s"] == pytest.approx(0.002, rel=1e-6) and fit["scale"] == pytest.approx(1.3, rel=1e-6)
    assert fit["prefill_scale"] == pytest.approx(1.1, rel=1e-6) and fit["steps"] == 10
    assert fit["mean_abs_rel_err"] < 1e-9
    with pytest.raises(ValueError, match="need at least 3"):
        fit_from_steps(steps[:2], base)


def test_step_comparison_splits_steps_by_kind_within_the_window():
    from kvserve.sim.cost_model import CostModel
    from kvserve.sim.validate import step_comparison

    base = CostModel(0.004, {"prefill_tokens": 0.0015, "decode_tokens": 0.0018, "logit_rows": 0.0,
                             "decode_ctx": 0.0025, "prefill_attn": 1.5, "rows": 0.0})
    steps = _synthetic_trace(ServerCalibrated(base, scale=1.25))
    assert step_comparison(steps, base, steps[0][0], steps[-2][0])["steps"] == 9  # the last one starts later
    c = step_comparison(steps, base, steps[0][0], steps[-1][0])
    assert {k: v["steps"] for k, v in c["by_kind"].items()} == {"decode": 5, "prefill": 3, "mixed": 2}
    assert c["turn_error"] == pytest.approx(1 / 1.25 - 1)  # the model predicts 80% of every turn


def test_read_idle_trace_waits_for_the_idle_server(tmp_path):
    """``read_idle_trace`` reads until the last step left nothing unfinished (the server writes its lines when it
    idles), and gives up after its timeout with what is there."""
    import threading

    from kvserve.sim.validate import read_idle_trace

    p = tmp_path / "steps.jsonl"
    p.write_text('{"t0": 1.0, "t1": 1.1, "more": 1, "rows": [[5, 0, 0, 1]]}\n')
    assert len(read_idle_trace(p, timeout=0.2)) == 1  # never idle: what is there, after the timeout

    def finish():
        with open(p, "a") as f:
            f.write('{"t0": 1.1, "t1": 1.2, "more": 0, "rows": [[1, 5, 0, 1]]}\n')

    threading.Timer(0.3, finish).start()
    steps = read_idle_trace(p, timeout=10.0)
    assert [more for _, _, more, _ in steps] == [True, False]


def test_level_fitted_replay_uses_the_calibration_fitted_on_the_levels_steps():
    """``--fit-each-level``: the level's server steps give back the server's own offset and scales, and the
    replay with them is the simulation of that server exactly; the uncalibrated model is not."""
    from kvserve.config import EngineConfig
    from kvserve.sim import trace as tr
    from kvserve.sim.cost_model import CostModel
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.validate import level_fitted

    base = CostModel(0.004, {"prefill_tokens": 0.0015, "decode_tokens": 0.0018, "logit_rows": 0.0001,
                             "decode_ctx": 0.0025, "prefill_attn": 1.5, "rows": 0.0002})
    server = ServerCalibrated(base, offset_s=0.002, scale=1.3, prefill_scale=1.1)
    config = EngineConfig.from_kwargs(max_num_seqs=4, block_size=16, max_num_batched_tokens=64)
    raw_sim = Simulator(config, base, 256, max_model_len=4096)
    trace = [tr.TraceRequest(0.3 * k, 40 + 7 * k, 5 + k % 4) for k in range(12)]
    real = Simulator(config, server, 256, max_model_len=4096).run(trace).summary
    steps = _synthetic_trace(server)
    fit, comp = level_fitted(raw_sim, steps + [(99.0, 99.1, False, [(1, 5, 0, 1)])], steps[0][0], steps[-1][0],
                             trace, None, real)
    assert fit["steps"] == 10  # the step after the level's window is left out
    assert fit["scale"] == pytest.approx(1.3, rel=1e-6) and fit["prefill_scale"] == pytest.approx(1.1, rel=1e-6)
    assert comp["median_ttft_ms"][2] == pytest.approx(0.0, abs=1e-6)
    assert comp["p99_tpot_ms"][2] == pytest.approx(0.0, abs=1e-6)
    raw = compare(real, raw_sim.run(trace).summary)
    assert raw["median_ttft_ms"][2] < -0.1  # the uncalibrated model runs faster than this server


def test_per_request_rows_pair_each_real_request_with_its_simulated_replay():
    from kvserve.bench.serve import RequestResult
    from kvserve.sim.validate import per_request, trace_from_records

    # sent out of list order (the second record left first), the third failed on the real server
    records = [{"start_s": 0.5, "prompt_token_ids": [1, 2, 3], "output_len": 2, "success": True, "ttft": 0.25,
                "e2el": 0.5},
               {"start_s": 0.0, "prompt_token_ids": [4, 5], "output_len": 3, "success": True, "ttft": 0.125,
                "e2el": 0.75},
               {"start_s": 1.0, "prompt_token_ids": [6], "output_len": 1, "success": False, "ttft": 0.0,
                "e2el": 0.0},
               {"start_s": None, "error": "never sent"}]
    trace = trace_from_records(records)
    sim = [RequestResult(success=True, ttft=0.1, e2el=0.7), RequestResult(success=True, ttft=0.2, e2el=0.4),
           RequestResult(success=False)]
    assert per_request(trace, records, sim) == [[0.0, 2, 3, 0.125, 0.1, 0.75, 0.7],
                                                [0.5, 3, 2, 0.25, 0.2, 0.5, 0.4],
                                                [1.0, 1, 1, None, None, None, None]]


def test_bracket_replays_each_level_between_the_calibrations_around_it(tmp_path, monkeypatch):
    """``kvserve sim validate --bracket``, the server being a simulator whose speed drifts: the calibrations
    before the two levels and after the last one measured scale 1.1, 1.3 and 1.5, and the levels ran at 1.2 and
    1.4. Each level's prediction (its calibration before) misses; the bracketed replay (the mean of the
    calibrations around it) is the level's own speed, so it meets every metric exactly."""
    import kvserve.sim.validate as V
    from kvserve.bench.serve import LoadRequest, RequestResult
    from kvserve.sim.cli import build_simulator
    from kvserve.sim.simulator import Simulator

    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "kv_bytes_per_token": 1, "max_position_embeddings": 4096,
            "cost_model": {"intercept_s": 0.004, "coef_s": {**{f: 0.0 for f in FEATURES}, "prefill_tokens": 0.0015,
                                                             "decode_tokens": 0.0018, "rows": 0.0002}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    flags = ["--model", "m.gguf", "--profile", str(path), "--base-url", "http://fake", "--rates", "2,4",
             "--save-calibration", "--calibrate-each-level", "--bracket", "--max-num-seqs", "4",
             "--num-kv-blocks", "256", "--max-num-batched-tokens", "64", "--output-json", str(tmp_path / "v.json"),
             "--warmup-s", "0"]
    p = argparse.ArgumentParser()
    V.add_args(p)
    args = p.parse_args(flags)
    eargs = {k: v for k, v in V.engine_kwargs(args).items() if k != "device"}
    raw_sim, _ = build_simulator(eargs, path, server_calibration=False)
    calibrations = iter([1.1, 1.3, 1.5])
    level_speed = iter([1.2, 1.4])

    def fake_calibrate(base_url, model, engine_args, profile_path, seed=0, replicas=1, runs=3, step_trace_path=None,
                       loaded_rounds=0):
        cal = {"offset_s": 0.001, "scale": next(calibrations), "prefill_scale": None}
        return Simulator(raw_sim.config, ServerCalibrated(raw_sim.step_time, 0.001, cal["scale"]), raw_sim.num_blocks,
                         raw_sim.max_model_len), cal

    async def fake_benchmark(base_url, model, reqs, offsets, max_duration=None):
        if len(reqs) == 4 and offsets == [0.0] * 4:  # the warm-up
            return [], 0.0
        server = Simulator(raw_sim.config, ServerCalibrated(raw_sim.step_time, 0.001, next(level_speed)),
                           raw_sim.num_blocks, raw_sim.max_model_len)
        trace = V.trace_from_records([{"start_s": o, "prompt_token_ids": r.prompt, "output_len": r.output_len}
                                      for r, o in zip(reqs, offsets)])
        res = server.run(trace)
        out = [RequestResult(success=x.success, prompt_tokens=x.prompt_tokens, output_tokens=x.output_tokens,
                             ttft=x.ttft, e2el=x.e2el, itl=list(x.itl), start_s=o)
               for x, o in zip(res.results, offsets)]
        return out, res.summary["duration_s"]

    monkeypatch.setattr(V, "level_requests", lambda a, rate, seed: [
        LoadRequest([seed * 100 + 10 * k + j for j in range(20 + 9 * k)], 4 + k % 3, k / rate) for k in range(10)])
    monkeypatch.setattr(V, "fetch_model", lambda url: "m")
    monkeypatch.setattr(V, "fetch_prefix_counters", lambda url: None)
    monkeypatch.setattr(V, "calibrate_profile", fake_calibrate)
    monkeypatch.setattr(V, "run_benchmark", fake_benchmark)
    assert V.run(args) == 0
    levels = json.loads((tmp_path / "v.json").read_text())["levels"]
    assert [lv["calibration_bracketed"]["scale"] for lv in levels] == pytest.approx([1.2, 1.4])
    assert [lv["calibration_after"]["scale"] for lv in levels] == [1.3, 1.5]
    for lv in levels:
        assert lv["errors"]["median_ttft_ms"] < -0.01  # the calibration before ran faster than the level
        for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_e2el_ms"):
            assert lv["errors_bracketed"][k] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="--bracket needs --save-calibration and --calibrate-each-level"):
        V.run(p.parse_args([f for f in flags if f != "--calibrate-each-level"]))


def test_mean_calibration_averages_each_number_and_keeps_a_lone_prefill_scale():
    from kvserve.sim.validate import mean_calibration

    a = {"offset_s": 0.002, "scale": 1.0, "prefill_scale": 1.5, "points": []}
    b = {"offset_s": 0.004, "scale": 2.0, "prefill_scale": None}
    assert mean_calibration(a, b) == {"offset_s": pytest.approx(0.003), "scale": 1.5, "prefill_scale": 1.5}
    assert mean_calibration({**a, "prefill_scale": 1.0}, {**b, "prefill_scale": 2.0})["prefill_scale"] == 1.5
    assert mean_calibration({**a, "prefill_scale": None}, b)["prefill_scale"] is None


def test_the_simulated_pool_defaults_to_the_profiled_machines(tmp_path):
    """A profile carries the KV memory ``serve`` got where it was made; the simulator takes it (re-cut into this
    run's blocks) unless the run names its pool, so the replay does not depend on the replaying machine's RAM."""
    from kvserve.sim.cli import build_simulator

    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "kv_bytes_per_token": 100, "max_position_embeddings": 64,
            "cost_model": {"intercept_s": 0.1, "coef_s": {f: 0.0 for f in FEATURES}},
            "kv_cache_memory_bytes": 100 * 16 * 50 + 99}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    args = {"model": "m.gguf"}
    assert build_simulator(args, p)[0].num_blocks == 50
    assert build_simulator({**args, "block_size": 32}, p)[0].num_blocks == 25
    assert build_simulator({**args, "num_kv_blocks": 7}, p)[0].num_blocks == 7
    assert build_simulator({**args, "kv_cache_memory_bytes": 100 * 16 * 3}, p)[0].num_blocks == 3
    prof["kv_cache_memory_bytes"] = "lots"
    p.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match="field 'kv_cache_memory_bytes' must be an integer >= 1, got 'lots'"):
        build_simulator(args, p)


def test_server_warm_up_sends_fresh_rounds_until_its_time_is_up(monkeypatch):
    """``warm_up_server``: rounds of 4 concurrent 40-token prompts, 16 tokens each, none repeated (a repeat would be
    a prefix-cache hit, not a warm step), ids in 2000-5038 (the calibration's random ids start at 1000 but are drawn
    fresh, the trace's are the dataset's); ``seconds=0`` is one round; ``--warmup-s -1`` is refused."""
    import time

    import kvserve.sim.validate as V

    rounds = []

    async def fake_benchmark(base_url, model, reqs, offsets, max_duration=None):
        rounds.append(reqs)
        time.sleep(0.02)
        return [], 0.0

    monkeypatch.setattr(V, "run_benchmark", fake_benchmark)
    assert V.warm_up_server("http://fake", "m", 0.0) == 4 and len(rounds) == 1
    rounds.clear()
    sent = V.warm_up_server("http://fake", "m", 0.1)
    assert sent == 4 * len(rounds) and len(rounds) >= 3
    prompts = [tuple(r.prompt) for reqs in rounds for r in reqs]
    assert len(set(prompts)) == len(prompts)
    assert all(len(p) == 40 and 2000 <= min(p) and max(p) <= 5038 for p in prompts)
    assert all(r.output_len == 16 for reqs in rounds for r in reqs)
    p = argparse.ArgumentParser()
    V.add_args(p)
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(ValueError, match=f"--warmup-s must be a finite number of seconds >= 0, got {float(bad)}"):
            V.run(p.parse_args(["--warmup-s", bad]))


def test_the_temporary_step_trace_is_removed_at_the_end(tmp_path, monkeypatch):
    """Without ``--step-trace``, the server started here writes its trace to a temporary folder, which is gone once
    the validation ends (with ``--step-trace FILE`` the file is the user's and stays)."""
    import os

    import kvserve.sim.validate as V
    from kvserve.bench.serve import LoadRequest, RequestResult

    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "kv_bytes_per_token": 1, "max_position_embeddings": 4096,
            "cost_model": {"intercept_s": 0.004, "coef_s": {**{f: 0.0 for f in FEATURES}, "prefill_tokens": 0.0015,
                                                             "decode_tokens": 0.0018}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    seen = {}

    class Proc:
        def poll(self):
            return None  # running until stopped

        def send_signal(self, sig):
            seen["exists_at_stop"] = os.path.isdir(os.path.dirname(seen["trace"]))

        def wait(self, timeout=None):
            return 0

    def fake_start(engine_args, timeout=600.0, step_trace=None):
        seen["trace"] = step_trace
        with open(step_trace, "w") as f:  # one idle step, long before the level: read at once, compared with none
            f.write(json.dumps({"t0": 0.0, "t1": 0.001, "more": 0, "rows": [[20, 0, 0, 1]]}) + "\n")
        return Proc(), "http://fake"

    async def fake_benchmark(base_url, model, reqs, offsets, max_duration=None):
        return [RequestResult(success=True, prompt_tokens=len(r.prompt), output_tokens=r.output_len, ttft=0.1,
                              e2el=0.1 + 0.01 * r.output_len, itl=[0.01] * (r.output_len - 1), start_s=o)
                for r, o in zip(reqs, offsets)], 1.0

    monkeypatch.setattr(V, "start_server", fake_start)
    monkeypatch.setattr(V, "level_requests", lambda a, rate, seed: [LoadRequest(list(range(20)), 4, 0.0)])
    monkeypatch.setattr(V, "fetch_model", lambda url: "m")
    monkeypatch.setattr(V, "fetch_prefix_counters", lambda url: None)
    monkeypatch.setattr(V, "run_benchmark", fake_benchmark)
    p = argparse.ArgumentParser()
    V.add_args(p)
    assert V.run(p.parse_args(["--model", "m.gguf", "--profile", str(path), "--rates", "1", "--warmup-s", "0",
                               "--num-kv-blocks", "64"])) == 0
    assert seen["exists_at_stop"] and os.path.basename(os.path.dirname(seen["trace"])).startswith("kvserve-validate-")
    assert not os.path.exists(os.path.dirname(seen["trace"]))
    def failing_start(engine_args, timeout=600.0, step_trace=None):
        seen["trace"] = step_trace
        raise ValueError("kvserve serve exited with 2: ...")

    monkeypatch.setattr(V, "start_server", failing_start)
    with pytest.raises(ValueError, match="kvserve serve exited"):
        V.run(p.parse_args(["--model", "m.gguf", "--profile", str(path), "--rates", "1", "--num-kv-blocks", "64"]))
    assert not os.path.exists(os.path.dirname(seen["trace"]))  # a server that never started leaves nothing either
    monkeypatch.setattr(V, "start_server", fake_start)
    kept = tmp_path / "steps.jsonl"
    assert V.run(p.parse_args(["--model", "m.gguf", "--profile", str(path), "--rates", "1", "--warmup-s", "0",
                               "--num-kv-blocks", "64", "--step-trace", str(kept)])) == 0
    assert seen["trace"] == str(kept) and kept.exists()


def test_real_repeats_run_the_slice_again_with_fresh_prompts_and_compare_with_the_first_run(tmp_path, monkeypatch):
    """``--real-repeats 3``: the level is sent three times, each repeat with new prompt token ids of the same
    lengths at the same offsets. The server is a simulator that runs the first run and the first repeat at scale
    1.2 and the second repeat at 1.5: the first repeat equals the first run exactly (error 0 on every metric), the
    second is slower (throughput down, TTFT up), and each repeat's simulated replay is the calibrated prediction
    for the requests it sent."""
    import kvserve.sim.validate as V
    from kvserve.bench.serve import LoadRequest, RequestResult
    from kvserve.sim.cli import build_simulator
    from kvserve.sim.simulator import Simulator

    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "kv_bytes_per_token": 1, "max_position_embeddings": 4096,
            "cost_model": {"intercept_s": 0.004, "coef_s": {**{f: 0.0 for f in FEATURES}, "prefill_tokens": 0.0015,
                                                             "decode_tokens": 0.0018, "rows": 0.0002}},
            "server_calibration": {"offset_s": 0.001, "scale": 1.2, "prefill_scale": None}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    flags = ["--model", "m.gguf", "--profile", str(path), "--base-url", "http://fake", "--rates", "3",
             "--real-repeats", "3", "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
             "--output-json", str(tmp_path / "v.json"), "--warmup-s", "0"]
    p = argparse.ArgumentParser()
    V.add_args(p)
    args = p.parse_args(flags)
    eargs = {k: v for k, v in V.engine_kwargs(args).items() if k != "device"}
    raw_sim, _ = build_simulator(eargs, path, server_calibration=False)
    speeds, sent = iter([1.2, 1.2, 1.5]), []

    async def fake_benchmark(base_url, model, reqs, offsets, max_duration=None):
        sent.append(reqs)
        server = Simulator(raw_sim.config, ServerCalibrated(raw_sim.step_time, 0.001, next(speeds)),
                           raw_sim.num_blocks, raw_sim.max_model_len)
        trace = V.trace_from_records([{"start_s": o, "prompt_token_ids": r.prompt, "output_len": r.output_len}
                                      for r, o in zip(reqs, offsets)])
        res = server.run(trace)
        return [RequestResult(success=x.success, prompt_tokens=x.prompt_tokens, output_tokens=x.output_tokens,
                              ttft=x.ttft, e2el=x.e2el, itl=list(x.itl), start_s=o)
                for x, o in zip(res.results, offsets)], res.summary["duration_s"]

    monkeypatch.setattr(V, "level_requests", lambda a, rate, seed: [
        LoadRequest([1000 + 10 * k + j for j in range(20 + 9 * k)], 4 + k % 3, k / rate) for k in range(10)])
    monkeypatch.setattr(V, "fetch_model", lambda url: "m")
    monkeypatch.setattr(V, "fetch_prefix_counters", lambda url: None)
    monkeypatch.setattr(V, "warm_up_server", lambda url, model, seconds: 0)
    monkeypatch.setattr(V, "run_benchmark", fake_benchmark)
    assert V.run(args) == 0
    assert len(sent) == 3
    first, *again = sent
    for reqs in again:
        assert [len(r.prompt) for r in reqs] == [len(r.prompt) for r in first]
        assert [(r.output_len, r.arrival_s) for r in reqs] == [(r.output_len, r.arrival_s) for r in first]
        assert all(a.prompt != b.prompt for a, b in zip(reqs, first))  # fresh tokens: no prefix cache hit
    assert sent[1][0].prompt != sent[2][0].prompt
    (level,) = json.loads((tmp_path / "v.json").read_text())["levels"]
    rep1, rep2 = level["repeats"]
    assert all(e == pytest.approx(0.0, abs=1e-12) for e in rep1["errors_vs_first"].values() if e is not None)
    assert all(e == pytest.approx(0.0, abs=1e-12) for e in rep1["errors"].values() if e is not None)
    assert rep2["errors_vs_first"]["output_throughput"] < -0.01
    assert rep2["errors_vs_first"]["median_tpot_ms"] > 0.1
    assert rep2["errors"]["median_tpot_ms"] < -0.1  # the calibration (1.2) predicts the first run's speed
    for k, e in level["errors_mean_of_runs"].items():  # the mean of the runs against the mean of their replays
        real = [level["real"][k], rep1["real"][k], rep2["real"][k]]
        sim = [level["sim"][k], rep1["sim"][k], rep2["sim"][k]]
        assert e == pytest.approx((sum(sim) - sum(real)) / sum(real), rel=1e-9)
    assert 0 > level["errors_mean_of_runs"]["median_tpot_ms"] > rep2["errors"]["median_tpot_ms"]
    with pytest.raises(ValueError, match="--real-repeats must be >= 1, got 0"):
        V.run(p.parse_args(flags + ["--real-repeats", "0"]))


@pytest.mark.parametrize("rates", ["1,,2", "abc", "1,x", ""])
def test_a_bad_rates_entry_is_an_error_naming_the_flag(rates, tmp_path):
    """An empty or non-numeric entry is refused before anything starts (``1,,2`` used to skip the empty one and
    run; ``abc`` gave float()'s message, naming no flag)."""
    import kvserve.sim.validate as V

    p = argparse.ArgumentParser()
    V.add_args(p)
    with pytest.raises(ValueError, match=r"^--rates must be a comma list of float, got"):
        V.run(p.parse_args(["--profile", str(tmp_path / "none.json"), "--rates", rates]))


@pytest.mark.parametrize("rates", ["0", "1,-2", "nan"])
def test_rates_must_be_positive(rates, tmp_path):
    import kvserve.sim.validate as V

    p = argparse.ArgumentParser()
    V.add_args(p)
    with pytest.raises(ValueError, match=r"^--rates must be positive numbers"):
        V.run(p.parse_args(["--profile", str(tmp_path / "none.json"), "--rates", rates]))


def test_a_profile_made_on_other_threads_than_the_server_warns(capsys):
    """A profile made on 2 threads replayed against a 1-thread server prices every step about 2x off; the command
    says so, with both numbers and the two ways out, on stderr."""
    from kvserve.sim.validate import warn_thread_mismatch

    prof = {"torch_threads": 2, "created": "2026-12-04T16:03:09"}
    assert warn_thread_mismatch(prof, {"num_threads": 1})
    err = capsys.readouterr().err
    assert "the profile was made with 2 threads (2026-12-04T16:03:09)" in err
    assert "runs with 1 (--num-threads)" in err
    assert "kvserve sim profile --num-threads 1" in err and "pass --num-threads 2" in err
    assert not warn_thread_mismatch(prof, {"num_threads": 2})
    assert not warn_thread_mismatch({"created": "old"}, {"num_threads": 1})  # a profile without the field
    assert capsys.readouterr().err == ""
