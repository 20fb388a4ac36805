"""``kvserve.sim.cluster``: N simulated replicas behind the shared router, exact under a constant step cost."""

import json
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.distributed.router import LeastLoadedRouter, PrefixAwareRouter, RoundRobinRouter
from kvserve.sim import trace as tr
from kvserve.sim.cluster import ClusterSimulator, parse_list, sweep
from kvserve.sim.cost_model import FEATURES, CostModel
from kvserve.sim.simulator import Simulator


def sim_for(num_blocks=256, **engine):
    return Simulator(EngineConfig.from_kwargs(block_size=4, **engine), CostModel(1.0, {f: 0.0 for f in FEATURES}),
                     num_blocks, max_model_len=4096)


def conversations(users: int, rounds: int, gap: float = 10.0) -> list:
    """Round k of user u shares its first k prefix blocks (8 tokens each) with the user's earlier rounds."""
    out = []
    for k in range(1, rounds + 1):
        for u in range(users):
            out.append(tr.TraceRequest(gap * k + u, 8 * k + 2, 2, tuple(100 * u + j for j in range(k)),
                                       prefix_block_tokens=8))
    return out


def test_one_replica_is_the_single_engine_simulator():
    trace = [tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.5, 4, 2),
             tr.TraceRequest(7.0, 9, 1, (1,), prefix_block_tokens=4)]
    single = sim_for().run(trace, {"ttft": 1.2})
    cluster = ClusterSimulator(sim_for(), 1, RoundRobinRouter()).run(trace, {"ttft": 1.2})
    assert [(r.ttft, r.e2el, r.itl) for r in cluster.results] == [(r.ttft, r.e2el, r.itl) for r in single.results]
    for key in ("completed", "steps", "duration_s", "goodput", "prefix_cache_hit_rate", "preemptions"):
        assert cluster.summary[key] == single.summary[key], key


def test_two_replicas_exact_times_and_placement():
    trace = [tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.5, 4, 2)]
    res = ClusterSimulator(sim_for(), 2, LeastLoadedRouter()).run(trace)
    # 0 -> replica 0, 1 -> replica 1 (0 is busier), 2 at 0.5 -> replica 0 (tie on load, lower KV usage? equal: id 0)
    assert res.replica_of == [0, 1, 0]
    # replica 0: step [0,1] first token of 0; 2 arrives at 0.5 and joins at 1: step [1,2]; replica 1 alone
    assert [r.ttft for r in res.results] == [1.0, 1.0, 1.5]
    assert [r.e2el for r in res.results] == [3.0, 3.0, 2.5]
    assert res.summary["requests_per_replica"] == [2, 1]


def test_prefix_router_keeps_conversations_together():
    trace = conversations(users=4, rounds=3)
    prefix = ClusterSimulator(sim_for(), 2, PrefixAwareRouter()).run(trace)
    rr = ClusterSimulator(sim_for(), 2, RoundRobinRouter()).run(trace)
    for u in range(4):
        rounds = [prefix.replica_of[i] for i, r in enumerate(trace) if r.prefix_ids[0] == 100 * u]
        assert len(set(rounds)) == 1
    # prompts of 10, 18, 26 tokens (4-token blocks): round k reuses 2 (k-1) blocks of 4 on its user's replica
    assert prefix.summary["prefix_cache_hit_rate"] == pytest.approx((4 * 8 + 4 * 16) / (4 * (10 + 18 + 26)))
    # round-robin over 4 users and 2 replicas puts each user's rounds on one replica too (an even count) ...
    assert rr.summary["prefix_cache_hit_rate"] == prefix.summary["prefix_cache_hit_rate"]
    # ... but not with 3 users: rounds alternate replicas, and only round 3 finds round 1's blocks
    trace3 = conversations(users=3, rounds=3)
    p3 = ClusterSimulator(sim_for(), 2, PrefixAwareRouter()).run(trace3).summary["prefix_cache_hit_rate"]
    r3 = ClusterSimulator(sim_for(), 2, RoundRobinRouter()).run(trace3).summary["prefix_cache_hit_rate"]
    assert p3 == pytest.approx((3 * 8 + 3 * 16) / (3 * 54)) and r3 == pytest.approx(3 * 8 / (3 * 54))


def test_sweep_scales_the_load_and_bad_lists():
    rows = sweep(sim_for(), conversations(2, 2), [1, 2], ["round-robin", "prefix"])
    assert [(s["replicas"], s["router"]) for s in rows] == [(1, "round-robin"), (1, "prefix"), (2, "round-robin"),
                                                            (2, "prefix")]
    assert rows[2]["duration_s"] < rows[0]["duration_s"]  # arrivals twice as fast
    assert parse_list("1, 4,64", "replicas", int) == [1, 4, 64]
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        parse_list("0", "replicas", int)
    with pytest.raises(ValueError, match="--router must be in prefix, least-loaded, round-robin"):
        parse_list("prefix,random", "router", str, ("prefix", "least-loaded", "round-robin"))
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        ClusterSimulator(sim_for(), 0, RoundRobinRouter())


def test_cli_sweep_and_bad_flags(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival_s": {i}, "prompt_tokens": 40, "output_tokens": 2, '
                             f'"prefix_block_ids": [{i % 2}]}}\n' for i in range(6)))
    profile = str(Path(__file__).resolve().parents[2] / "docs" / "simulator_profile.json")
    out = tmp_path / "rows.json"
    args = ["sim", "--profile", profile, "--dataset", "jsonl", "--trace-file", str(trace), "--prefix-block-tokens",
            "32", "--replicas", "1,2", "--router", "prefix,round-robin", "--output-json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["replicas"], r["router"], r["completed"]) for r in rows] == [
        (1, "prefix", 6), (1, "round-robin", 6), (2, "prefix", 6), (2, "round-robin", 6)]
    assert rows[2]["requests_per_replica"] == [3, 3]  # prefix: the two prefixes on their own replicas
    assert "replicas" in capsys.readouterr().out
    assert main(args[:-4] + ["--router", "random"]) == 2
    assert "--router must be in prefix, least-loaded, round-robin" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err
