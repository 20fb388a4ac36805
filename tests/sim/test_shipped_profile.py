"""The shipped profile (``docs/simulator_profile.json``): labelled with its machine, it reproduces its own
measurement, ``kvserve plan`` answers with a setting on it, and ``kvserve sim`` warns when a trace offers more load
than the simulated engine serves."""

import json
import statistics
from pathlib import Path

import pytest

from kvserve.entrypoints.cli import main
from kvserve.sim.profile import PROFILE_FORMAT, load, refit
from kvserve.sim.simulator import overload_warning

SHIPPED = Path(__file__).resolve().parents[2] / "docs" / "simulator_profile.json"


def test_shipped_profile_is_labelled_and_current():
    prof, _ = load(SHIPPED, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert prof["format"] == PROFILE_FORMAT and prof["quantization"] == "auto"
    machine = prof["machine"]
    assert machine["cpu_model"] and machine["cpus"] >= 1 and len(machine["kvserve_commit"]) == 40
    assert prof["created"].startswith("20") and prof["fit"]["n"] == len(prof["samples"]) >= 90


def test_shipped_profile_reproduces_its_own_measurement():
    """Refitting its raw samples gives its cost model back, and the model predicts each decode batch's measured
    median step time within 15% (batch 1: the per-output-token time a user sees)."""
    prof, cost = load(SHIPPED)
    again = refit(prof).to_dict()
    assert again["intercept_s"] == pytest.approx(cost.to_dict()["intercept_s"], rel=1e-9)
    assert again["coef_s"] == pytest.approx(cost.to_dict()["coef_s"], rel=1e-9, abs=1e-12)
    decodes = {}
    for s in prof["samples"]:
        prefill_tokens, decode_tokens = s["features"][0], s["features"][1]
        if prefill_tokens == 0:
            decodes.setdefault(decode_tokens, []).append(s)
    assert {1, 4, 16, 32} <= set(decodes)
    for batch in (1, 4, 16, 32):
        measured = statistics.median(s["step_s"] for s in decodes[batch])
        predicted = statistics.median(cost.step_time(tuple(s["features"])) for s in decodes[batch])
        assert predicted == pytest.approx(measured, rel=0.15), batch
    assert 0.005 < statistics.median(s["step_s"] for s in decodes[1]) < 0.1  # ms per token, not seconds


def _trace(path: Path, n: int, gap_s: float, output_tokens: int) -> Path:
    path.write_text("".join(json.dumps({"arrival_s": gap_s * i, "prompt_tokens": 64, "output_tokens": output_tokens})
                            + "\n" for i in range(n)))
    return path


@pytest.mark.real_model  # the default model's file name, which the profile is checked against
def test_plan_answers_with_a_setting_on_the_shipped_profile(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl", 40, 2.0, 24)
    rc = main(["plan", "--profile", str(SHIPPED), "--dataset", "jsonl", "--trace-file", str(trace),
               "--request-rate", "0.5", "--slo", "ttft:2000", "tpot:200", "--max-num-seqs", "2,8",
               "--max-num-batched-tokens", "256"])
    assert rc == 0
    assert "best: max_num_seqs=" in capsys.readouterr().out


@pytest.mark.real_model
def test_sim_warns_when_the_offered_load_exceeds_the_simulated_capacity(tmp_path, capsys):
    dense = _trace(tmp_path / "dense.jsonl", 200, 0.01, 128)  # 100 req/s of 128 output tokens each
    assert main(["sim", "--profile", str(SHIPPED), "--dataset", "jsonl", "--trace-file", str(dense),
                 "--max-num-seqs", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: the offered load (100 req/s) exceeds the simulated capacity" in err
    sparse = _trace(tmp_path / "sparse.jsonl", 20, 5.0, 16)  # one short request every 5 s: idle most of the time
    assert main(["sim", "--profile", str(SHIPPED), "--dataset", "jsonl", "--trace-file", str(sparse),
                 "--max-num-seqs", "8", "--quiet"]) == 0
    assert "exceeds the simulated capacity" not in capsys.readouterr().err


def test_overload_warning_needs_a_busy_engine_and_an_arrival_span():
    from kvserve.sim.trace import TraceRequest

    trace = [TraceRequest(float(i), 10, 10) for i in range(11)]  # one a second for 10 s: 1 req/s offered
    busy = {"duration_s": 100.0, "busy_s": 99.0, "completed": 11}
    assert "offered load (1 req/s)" in overload_warning(trace, busy)
    assert "about 0.111 req/s" in overload_warning(trace, busy)
    assert overload_warning(trace, {**busy, "busy_s": 50.0}) is None  # idle half the time: not overloaded
    assert overload_warning(trace, {**busy, "duration_s": 11.0, "busy_s": 10.5}) is None  # kept up
    at_once = [TraceRequest(0.0, 10, 10) for _ in range(5)]
    assert overload_warning(at_once, busy) is None
