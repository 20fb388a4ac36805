"""``python -m benchmarks.ray_serve``'s pieces that need no Ray cluster: per-replica counts from the
router's decisions, the replay of a run's records on the simulated cluster, the real-vs-simulated table."""

import pytest

pytest.importorskip("ray.serve", reason="needs the optional Ray extra: pip install -e '.[ray]'")

pytestmark = pytest.mark.ray

from benchmarks import ray_serve as rsb  # noqa: E402
from kvserve.bench.workloads import LoadRequest  # noqa: E402
from tests.sim.test_replay import records, sim_for  # noqa: E402


def test_salted_and_replica_counts():
    s = rsb.salted([[LoadRequest([1, 2], 3), LoadRequest([1, 2, 4], 3)]], 1000)
    assert [r.prompt for r in s[0]] == [[1000, 1, 2], [1000, 1, 2, 4]] and s[0][1].output_len == 3
    recs = [{"response_id": "cmpl-a"}, {"response_id": "cmpl-b"}, {"response_id": "cmpl-c"}, {"response_id": ""}]
    decisions = [("cmpl-a-0", "r1", None), ("cmpl-b-0", "r2", None), ("cmpl-c-0", "r1", None), ("x-0", "r2", None)]
    assert rsb.replica_counts(recs, decisions) == [2, 1]
    assert [r["replica"] for r in recs] == ["r1", "r2", "r1", None]


def test_simulate_and_the_validation_table():
    recs = records()
    for r in recs:  # the real run: users 0 and 2 on replica "b", user 1 on "a", but user 2's last round on "a"
        r["replica"] = "a" if r["conversation"] == 1 or (r["conversation"] == 2 and r["round"] == 2) else "b"
    sims = rsb.simulate(sim_for(), recs, 2, "prefix")
    assert list(sims) == ["prefix", "recorded placement"]
    assert sims["prefix"]["requests_per_replica"] == [6, 3] and sims["prefix"]["router"] == "prefix"
    assert sims["recorded placement"]["requests_per_replica"] == [5, 4]
    # user 2's round 3 misses on "a": 24 + 24 + 8 of 3 x 51 prompt tokens hit (prefix router: 3 x 24)
    assert sims["recorded placement"]["prefix_cache_hit_rate"] == pytest.approx(56 / 153)
    assert sims["prefix"]["prefix_cache_hit_rate"] == pytest.approx(72 / 153)
    real = dict(sims["prefix"], median_ttft_ms=800.0, prefix_cache_hit_rate=0.5, requests_per_replica=[5, 4])
    table = rsb.format_validation(real, sims)
    assert "TTFT p50 ms" in table and "25.0%" in table  # 1000 ms simulated vs 800 ms real
    assert "-2.9 pt" in table  # hit rate 47.1% simulated vs 50.0% real
    assert "requests per replica: real [5, 4], prefix [6, 3], recorded placement [5, 4]" in table


def test_simulate_applies_the_contention():
    """Step-time factors of replicas sharing a host (``contention``) slow the replay's overlapping steps."""
    recs = [{"conversation": u, "round": 0, "start_s": 0.0, "output_len": 2, "replica": "ab"[u],
             "prompt_token_ids": [100 * (u + 1) + j for j in range(8)]} for u in range(2)]
    plain = rsb.simulate(sim_for(), recs, 2, "round-robin")["recorded placement"]
    shared = rsb.simulate(sim_for(), recs, 2, "round-robin", ([1.0, 1.5], None))["recorded placement"]
    assert plain["median_ttft_ms"] == 1000.0 and plain["median_e2el_ms"] == 2000.0  # 1 s steps, side by side
    assert shared["median_ttft_ms"] == 1500.0 and shared["median_e2el_ms"] == 3000.0  # both steps at 1.5 s


def test_recorded_placement_falls_back_to_the_least_loaded():
    from kvserve.distributed.router import ReplicaLoad

    policy = rsb.RecordedPlacement([1, None, 5])
    loads = {0: ReplicaLoad(2, 0), 1: ReplicaLoad(0, 0)}
    assert [policy.choose([], loads) for _ in range(4)] == [1, 1, 1, 1]
    assert rsb.RecordedPlacement([0]).choose([], loads) == 0


def test_shutdown_ray_is_bounded_when_serve_hangs(monkeypatch):
    """A ``serve.shutdown()`` that never returns (or raises) still ends in ``ray.shutdown()``, after the timeout."""
    import threading
    import time

    from kvserve.entrypoints.ray import ingress

    release, calls = threading.Event(), []
    monkeypatch.setattr(ingress.serve, "shutdown", lambda: release.wait(30))
    monkeypatch.setattr(ingress.ray, "shutdown", lambda: calls.append("ray"))
    t = time.monotonic()
    ingress.shutdown_ray(timeout_s=0.2)
    assert calls == ["ray"] and time.monotonic() - t < 5
    release.set()

    def boom():
        raise RuntimeError("controller gone")

    monkeypatch.setattr(ingress.serve, "shutdown", boom)
    ingress.shutdown_ray(timeout_s=5)
    assert calls == ["ray", "ray"]
