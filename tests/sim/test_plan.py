"""``kvserve plan`` and ``kvserve sim`` through the CLI, on a hand-written profile and a JSONL trace (no model)."""

import json
import re

import pytest

from kvserve.entrypoints.cli import main
from kvserve.sim.cost_model import FEATURES
from kvserve.sim.profile import PROFILE_FORMAT

pytestmark = pytest.mark.real_model


@pytest.fixture
def files(tmp_path):
    prof = {"format": PROFILE_FORMAT, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32",
            "kv_bytes_per_token": 47104, "max_position_embeddings": 8192,
            "cost_model": {"intercept_s": 0.02, "coef_s": {**{f: 0.0 for f in FEATURES}, "tokens": 0.001}}}
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(prof))
    t = tmp_path / "trace.jsonl"
    t.write_text("".join(json.dumps({"arrival_s": 0.5 * i, "prompt_tokens": 40 + i, "output_tokens": 8}) + "\n"
                         for i in range(20)))
    return p, t


def test_sim_cli_prints_the_bench_serve_table(files, capsys, tmp_path):
    p, t = files
    out_json = tmp_path / "sim.json"
    rc = main(["sim", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(t), "--num-kv-blocks", "64",
               "--goodput", "ttft:1000", "--output-json", str(out_json), "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "successful requests" in text and "prefix cache hit rate" in text
    s = json.loads(out_json.read_text())["summary"]
    assert s["completed"] == 20 and s["total_output_tokens"] == 160
    assert (tmp_path / "plots" / "kv_usage.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_plan_picks_a_setting_and_reports_the_knee(files, capsys, tmp_path, monkeypatch):
    import matplotlib.figure

    ticks = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):  # the goodput plot's x tick labels as drawn
        fig.canvas.draw()
        ax = fig.axes[0]
        ticks.append(([t.get_text() for t in ax.get_xticklabels()], [t.get_text() for t in
                                                                      ax.get_xticklabels(minor=True)]))
        return save(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    p, t = files
    rc = main(["plan", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(t), "--slo", "ttft:200",
               "tpot:100", "--max-num-seqs", "1,8", "--max-num-batched-tokens", "64", "--chunked-prefill", "on",
               "--request-rate", "8", "--top", "1", "--plot", str(tmp_path / "plan.png")])  # 1 at a time: too slow
    assert rc == 0
    text = capsys.readouterr().out
    assert "best: max_num_seqs=8" in text and "knee:" in text
    assert (tmp_path / "plan.png").stat().st_size > 0
    (major, minor), = ticks
    assert len(major) >= 2 and all(float(x) > 0 for x in major)  # the swept rates as plain numbers
    assert not any(minor)  # no 3x10^-1-style minor labels crowding them


def test_plan_says_when_no_setting_meets_the_slo(files, capsys):
    p, t = files
    rc = main(["plan", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(t), "--slo", "ttft:1",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--chunked-prefill", "on",
               "--request-rate", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no setting meets ttft <= 1 ms for 90% of requests at 2 req/s; best was max_num_seqs=4" in err


def test_sim_refuses_a_profile_of_another_model(files, capsys, tmp_path):
    p, t = files
    rc = main(["sim", "--profile", str(p), "--model", str(tmp_path / "Other.gguf"), "--dataset", "jsonl",
               "--trace-file", str(t)])
    assert rc == 2
    assert "measured on another model than 'Other.gguf'" in capsys.readouterr().err


def test_sim_names_the_line_of_a_malformed_trace(files, capsys, tmp_path):
    p, t = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(t.read_text().splitlines()[0] + "\n" + '{"arrival_s": 1, "prompt_tokens": 8,\n')
    rc = main(["sim", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(bad)])
    assert rc == 2
    assert "bad.jsonl: line 2: not valid JSON" in capsys.readouterr().err
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.0,9\n")
    rc = main(["sim", "--profile", str(p), "--dataset", "azure", "--trace-file", str(csv)])
    assert rc == 2
    assert "a.csv: line 3: expected 3 fields, got 2" in capsys.readouterr().err
    rc = main(["sim", "--profile", str(p), "--dataset", "azure", "--data-dir", str(tmp_path / "nowhere")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "data folder not found: " in err and "nowhere" in err and "pass --data-dir" in err


def test_plan_does_not_pick_a_budget_that_cuts_requests_short(files, capsys, tmp_path):
    """Without chunked prefill a sequence may not outgrow the token budget: with 64 tokens the 57-59-token prompts
    (8 output tokens asked) end early. The simulator counts them as completed, as the benchmark client does, and
    reports them as ``truncated``; the planner does not let such a setting meet the SLOs."""
    p, t = files
    out_json = tmp_path / "sim.json"
    assert main(["sim", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(t), "--num-kv-blocks", "64",
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens", "64", "--output-json",
                 str(out_json)]) == 0
    s = json.loads(out_json.read_text())["summary"]
    assert (s["completed"], s["truncated"], s["total_output_tokens"]) == (20, 3, 17 * 8 + 7 + 6 + 5)
    assert re.search(r"cut short \(finish_reason length\) +3 ", capsys.readouterr().out)
    args = ["plan", "--profile", str(p), "--dataset", "jsonl", "--trace-file", str(t), "--slo", "ttft:5000",
            "--max-num-seqs", "4", "--chunked-prefill", "off", "--num-kv-blocks", "64", "--top", "1"]
    assert main(args + ["--max-num-batched-tokens", "64,128"]) == 0
    assert "best: max_num_seqs=4 max_num_batched_tokens=128" in capsys.readouterr().out
    assert main(args + ["--max-num-batched-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert "with 85.0% of requests meeting every SLO (goodput" in err  # 17 of 20 in full
    assert "req/s, 0 rejected, 3 cut short; a setting that rejects or cuts short any request cannot meet" in err
    # nothing meets an impossible SLO: the setting named as the best is one that serves every request in full
    tight = [a if a != "ttft:5000" else "ttft:1" for a in args]
    assert main(tight + ["--max-num-batched-tokens", "64,128"]) == 2
    assert "best was max_num_seqs=4 max_num_batched_tokens=128" in capsys.readouterr().err
