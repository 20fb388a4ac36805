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


def test_contention_stretches_steps_that_overlap_on_one_host():
    # constant 1 s steps; with two replicas of a host busy each step runs at half speed (processor sharing)
    alone_then_overlap = [tr.TraceRequest(0.0, 4, 1), tr.TraceRequest(0.5, 4, 1)]
    res = ClusterSimulator(sim_for(), 2, RoundRobinRouter(), contention=[1.0, 2.0]).run(alone_then_overlap)
    # A: 0.5 s alone, then its last 0.5 s of work at half speed -> ends at 1.5; B: 1 s at half speed while A runs
    # (0.5 s of work), then alone -> ends at 2.0
    assert [r.ttft for r in res.results] == [1.5, 1.5]
    assert res.summary["busy_imbalance"] == 1.0  # 1.5 s busy each
    together = [tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.0, 4, 3)]
    res = ClusterSimulator(sim_for(), 2, RoundRobinRouter(), contention=[1.0, 2.0]).run(together)
    assert [(r.ttft, r.e2el) for r in res.results] == [(2.0, 6.0), (2.0, 6.0)]
    # four replicas in hosts of two: each step overlaps one other on its host; in one host of four: three
    four = [tr.TraceRequest(0.0, 4, 1) for _ in range(4)]
    assert [r.ttft for r in ClusterSimulator(sim_for(), 4, RoundRobinRouter(), contention=[1, 2]).run(four).results] \
        == [2.0] * 4
    assert [r.ttft for r in ClusterSimulator(sim_for(), 4, RoundRobinRouter(), contention=[1, 2, 3, 4]).run(
        four).results] == [4.0] * 4
    # factors of 1 (or hosts of one replica) change nothing
    trace = [tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.5, 4, 2)]
    plain = ClusterSimulator(sim_for(), 2, LeastLoadedRouter()).run(trace)
    for c in ([1.0], [1.0, 1.0]):
        res = ClusterSimulator(sim_for(), 2, LeastLoadedRouter(), contention=c).run(trace)
        assert [(r.ttft, r.e2el, r.itl) for r in res.results] == [(r.ttft, r.e2el, r.itl) for r in plain.results]
    # a step's prompt-chunk part takes prefill_contention's factor: 1 s steps, half of them the 4-token prompt
    half = Simulator(EngineConfig.from_kwargs(block_size=4), CostModel(0.5, {**{f: 0.0 for f in FEATURES},
                                                                            "prefill_tokens": 0.125}), 256, 4096)
    prompts = [tr.TraceRequest(0.0, 4, 1), tr.TraceRequest(0.0, 4, 1)]
    res = ClusterSimulator(half, 2, RoundRobinRouter(), [1.0, 2.0]).run(prompts)
    assert [r.ttft for r in res.results] == [1.5, 1.5]  # 0.5 s at 2x + 0.5 s at 1x: prompts not slowed by default
    res = ClusterSimulator(half, 2, RoundRobinRouter(), [1.0, 2.0], prefill_contention=[1.0, 2.0]).run(prompts)
    assert [r.ttft for r in res.results] == [2.0, 2.0]
    res = ClusterSimulator(half, 2, RoundRobinRouter(), [1.0, 2.0], prefill_contention=[1.0, 4.0]).run(prompts)
    assert [r.ttft for r in res.results] == [3.0, 3.0]  # 0.5 s at 2x + 0.5 s at 4x
    with pytest.raises(ValueError, match=r"prefill_contention needs as many factors as contention \(2\), got 1"):
        ClusterSimulator(half, 2, RoundRobinRouter(), [1.0, 2.0], prefill_contention=[1.0])
    with pytest.raises(ValueError, match=r"prefill_contention\[1\]"):
        ClusterSimulator(half, 2, RoundRobinRouter(), [1.0, 2.0], prefill_contention=[1.0, -2.0])
    for bad, match in (([], "at least one factor"), ([1.0, 0.0], r"contention\[1\] .*2 replica"),
                       (["x"], "list of numbers"), ([1.0, float("inf")], r"contention\[1\]")):
        with pytest.raises(ValueError, match=match):
            ClusterSimulator(sim_for(), 2, RoundRobinRouter(), contention=bad)


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


@pytest.mark.real_model
def test_cli_sweep_and_bad_flags(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival_s": {i * 0.01}, "prompt_tokens": 40, "output_tokens": 2, '
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
    # one host of two replicas whose steps take 3x as long side by side: the 2-replica runs get slower
    out2 = tmp_path / "rows2.json"
    assert main(args[:-1] + [str(out2), "--contention", "1,3"]) == 0
    shared = json.loads(out2.read_text())
    assert "hosts of 2 replicas, step-time factors [1.0, 3.0]" in capsys.readouterr().out
    assert rows[2]["median_tpot_ms"] < shared[2]["median_tpot_ms"]
    assert shared[0]["median_ttft_ms"] == rows[0]["median_ttft_ms"]  # one replica: nothing to share with
    assert shared[2]["median_e2el_ms"] > rows[2]["median_e2el_ms"]
    assert main(args[:-1] + [str(out2), "--contention", "none"]) == 0
    assert json.loads(out2.read_text())[2]["median_e2el_ms"] == rows[2]["median_e2el_ms"]
    assert main(args + ["--contention", "1,0"]) == 2
    assert "--contention[1] (the step-time factor with 2 replica(s) of a host busy) must be a finite number > 0, " \
           "got 0.0" in capsys.readouterr().err
    assert main(args + ["--contention", "x"]) == 2
    assert "--contention must be a comma list of numbers > 0 (e.g. 1,1.6), got 'x'" in capsys.readouterr().err
    single = args[:args.index("--replicas")] + ["--contention", "1,2"]
    assert main(single) == 2  # one engine: nothing to share the host with
    assert "--contention needs --replicas N > 1" in capsys.readouterr().err
    assert main(single[:-2] + ["--router", "random"]) == 2
    assert "--router must be in prefix, least-loaded, round-robin" in capsys.readouterr().err
    assert main(args[:-4] + ["--router", "random"]) == 2
    assert "--router must be in prefix, least-loaded, round-robin" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err
