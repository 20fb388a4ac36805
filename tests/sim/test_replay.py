"""Replaying what a benchmark sent (``bench serve``'s request records: actual send offsets, prompt token ids,
output lengths) on the simulated cluster, under a constant 1 s step so every value is exact."""

import json

import pytest

from kvserve.config import EngineConfig
from kvserve.distributed.router import PrefixAwareRouter, RoundRobinRouter
from kvserve.entrypoints.cli import main
from kvserve.sim.cluster import ClusterSimulator
from kvserve.sim.cost_model import FEATURES, CostModel
from kvserve.sim.simulator import Simulator
from kvserve.sim.trace import read_bench_records as trace_from_records

SUFFIX = [7]  # a one-token "generation prompt" after each round's head


def sim_for():
    return Simulator(EngineConfig.from_kwargs(block_size=4), CostModel(1.0, {f: 0.0 for f in FEATURES}), 256,
                     max_model_len=4096)


def records(users: int = 3, rounds: int = 3) -> list:
    """Bench-style records of closed-loop conversations: round k of user u (sent at 10 k + u s) is the user's
    first 8 (k + 1) tokens plus ``SUFFIX``, so round k's head extends round k - 1's; 2 output tokens each."""
    out = []
    for u in range(users):
        for k in range(rounds):
            out.append({"conversation": u, "round": k, "start_s": 10.0 * k + u, "output_len": 2,
                        "prompt_token_ids": [1000 * (u + 1) + j for j in range(8 * (k + 1))] + SUFFIX})
    return out


def test_bench_records_replay_in_send_order():
    recs = records()
    trace = trace_from_records(recs + [{"start_s": None, "error": "not sent"}])
    assert [t.arrival_s for t in trace] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 20.0, 21.0, 22.0]
    assert [t.prompt_len for t in trace] == [9] * 3 + [17] * 3 + [25] * 3
    assert trace[4].token_ids == recs[4].get("prompt_token_ids") and trace[4].output_len == 2
    with pytest.raises(ValueError, match="prompt_token_ids"):
        trace_from_records([{"start_s": 0.0, "prompt": "text", "output_len": 2}])


def test_replay_on_two_replicas_exact():
    trace = trace_from_records(records())
    prefix = ClusterSimulator(sim_for(), 2, PrefixAwareRouter()).run(trace)
    # round 1 of users 0, 1, 2 at 0, 1, 2 s: replica 0, then 1 (0 is busy until 2 s), then 0 (free again at 2 s)
    assert prefix.replica_of == [0, 1, 0] * 3  # later rounds follow their user's blocks
    # round k reuses round k - 1's 8 k head tokens (2 k blocks of 4): 8 + 16 of 9 + 17 + 25 prompt tokens per user
    assert prefix.summary["prefix_cache_queries"] == 3 * 51
    assert prefix.summary["prefix_cache_hit_rate"] == pytest.approx(3 * 24 / (3 * 51))
    assert [r.ttft for r in prefix.results] == [1.0] * 9 and [r.e2el for r in prefix.results] == [2.0] * 9
    assert prefix.summary["requests_per_replica"] == [6, 3]
    rr = ClusterSimulator(sim_for(), 2, RoundRobinRouter()).run(trace)
    assert rr.replica_of == [0, 1, 0, 1, 0, 1, 0, 1, 0]  # 3 users on 2 replicas: each conversation alternates
    # only round 3 finds its user's round 1 (2 blocks) on its replica
    assert rr.summary["prefix_cache_hit_rate"] == pytest.approx(3 * 8 / (3 * 51))
    again = ClusterSimulator(sim_for(), 2, PrefixAwareRouter()).run(trace)
    assert again.summary == {**prefix.summary, "sim_wall_s": again.summary["sim_wall_s"]}


def test_sim_cli_replays_a_bench_report(tmp_path, capsys, monkeypatch):
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"completed": 9, "requests": records()}))
    import kvserve.sim.cli as cli

    monkeypatch.setattr(cli, "build_simulator", lambda *a, **k: (sim_for(), {"model": "m"}))
    out = tmp_path / "sim.json"
    assert main(["sim", "--dataset", "bench", "--trace-file", str(report), "--replicas", "2", "--router",
                 "prefix,round-robin", "--output-json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())
    assert [r["router"] for r in rows] == ["prefix", "round-robin"]
    assert [round(r["prefix_cache_hit_rate"] * 51) for r in rows] == [24, 8]
    assert main(["sim", "--dataset", "bench", "--trace-file", str(tmp_path / "missing.json")]) == 2
    assert "bench serve report" in capsys.readouterr().err
