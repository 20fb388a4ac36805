"""The dashboard's snapshot of a block pool in a known state, and its metric history: model-free, exact."""

from types import SimpleNamespace

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.entrypoints.dashboard.snapshot import MetricsHistory, build_snapshot
from kvserve.metrics import percentile
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import EOS, add, fake_run


def make_request(rid, tokens, max_tokens=8, prompt=None, priority=0):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_total_tokens=64, prompt=prompt,
                   arrival_time=100.0, priority=priority)


def compute(kv, req, n, hits=()):
    """Allocate and 'compute' n more tokens of req (as a step would), then cache its full blocks."""
    assert kv.allocate_slots(req, n, hits) is not None
    req.num_computed_tokens += len(hits) * kv.block_size + n
    kv.cache_computed_blocks(req)


@pytest.fixture
def pool():
    """10 blocks of 4 tokens. r1 and r2 share a 2-block prefix; r3 and r4 finished, their blocks cached.

    Free queue afterwards: 6 7 8 9 (never used), then 3 (r3's), then 5 4 (r4's, freed tail first).
    """
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    r1 = make_request("r1", [1, 2, 3, 4, 5, 6, 7, 8], prompt="the shared prefix")
    compute(kv, r1, 8)                                   # blocks 0 1
    r2 = make_request("r2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], priority=3)
    hits = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1]
    compute(kv, r2, 2, hits)                             # blocks 0 1 (shared) + 2
    r3 = make_request("r3", [20, 21, 22, 23])
    compute(kv, r3, 4)                                   # block 3
    r4 = make_request("r4", [30, 31, 32, 33, 34, 35, 36, 37])
    compute(kv, r4, 8)                                   # blocks 4 5
    kv.free(r3)
    kv.free(r4)
    r5 = make_request("r5", [40, 41, 42])                # waiting, preempted once
    r5.status, r5.num_preemptions = RequestStatus.PREEMPTED, 1
    for r in (r1, r2):
        r.status = RequestStatus.RUNNING
    kv.check_integrity()
    return kv, [r1, r2], [r5]


def test_snapshot_of_known_pool(pool):
    kv, running, waiting = pool
    snap = build_snapshot(kv, running, waiting, seq=7, now=101.5, wall_time=1234.0)
    k = snap["kv"]
    assert snap["version"] == 1 and snap["seq"] == 7 and snap["time"] == 1234.0
    assert k["blocks"] == "ssucccffff"
    assert k["shared"] == {"0": 2, "1": 2}
    assert k["cached_lru"] == [3, 5, 4]
    assert (k["num_blocks"], k["block_size"], k["used_blocks"], k["shared_blocks"], k["cached_blocks"],
            k["free_blocks"]) == (10, 4, 3, 2, 3, 7)
    assert k["kv_cache_usage_perc"] == pytest.approx(kv.stats(running).usage) == pytest.approx(0.3)
    assert k["tokens_allocated"] == 12 and k["tokens_stored"] == 10 == kv.stats(running).tokens_stored
    assert k["waste"] == pytest.approx(2 / 12)
    assert [r["block_table"] for r in snap["running"]] == [[0, 1], [0, 1, 2]]
    r2 = snap["running"][1]
    assert (r2["id"], r2["status"], r2["prompt_tokens"], r2["output_tokens"], r2["num_tokens"],
            r2["num_computed_tokens"], r2["priority"], r2["max_tokens"]) == ("r2", "running", 10, 0, 10, 10, 3, 8)
    assert r2["age_s"] == 1.5 and r2["spec_acceptance"] is None and "prompt" not in r2
    [w] = snap["waiting"]
    assert (w["id"], w["status"], w["num_preemptions"], w["num_computed_tokens"]) == ("r5", "preempted", 1, 0)
    assert "block_table" not in w
    assert (snap["num_running"], snap["num_waiting"], snap["truncated"]) == (2, 1, {"running": 0, "waiting": 0})



def test_tokens_stored_skips_entries_freed_behind_a_sliding_window():
    """Window 8, blocks of 4: after the first decode of a 20-token prompt, blocks 0-2 went back to the pool and the
    table shows them as NULL_BLOCK_ID (0, also a real block's id); they hold none of the request's tokens."""
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    sched = Scheduler(SchedulerConfig(), kv, eos_token_ids=[EOS])
    req = add(sched, "a", 20, 5)
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, fake_run(so))
    assert kv.get_block_ids(req)[:3] == [NULL_BLOCK_ID] * 3 and req.num_computed_tokens == 22
    snap = build_snapshot(kv, [req], [])
    assert snap["kv"]["tokens_stored"] == kv.stats([req]).tokens_stored == 2 * 4 + 2  # blocks 3, 4 and 2 of 5

def test_lru_order_is_eviction_order(pool):
    kv, running, waiting = pool
    r6 = make_request("r6", list(range(50, 70)))
    assert kv.allocate_slots(r6, 20) == [6, 7, 8, 9, 3]  # never-used blocks first, then the LRU cached one
    snap = build_snapshot(kv, running, waiting)
    assert snap["kv"]["blocks"] == "ssuuccuuuu"
    assert snap["kv"]["cached_lru"] == [5, 4]


def test_snapshot_shares_nothing_with_the_engine(pool):
    kv, running, waiting = pool
    snap = build_snapshot(kv, running, waiting)
    snap["running"][0]["block_table"].append(99)
    assert kv.get_block_ids(running[0]) == [0, 1]


def test_prompts_only_when_asked(pool):
    kv, running, waiting = pool
    assert all("prompt" not in r for r in build_snapshot(kv, running, waiting)["running"])
    snap = build_snapshot(kv, running, waiting, show_prompts=True)
    assert [r["prompt"] for r in snap["running"]] == ["the shared prefix", None]


def test_bounded_size(pool):
    kv, running, waiting = pool
    snap = build_snapshot(kv, running, waiting, max_cells=8, density_bins=4, max_requests=1, max_table_entries=1)
    k = snap["kv"]
    assert k["blocks"] is None and k["shared"] is None and k["cached_lru"] is None
    # bins of 3 blocks over "ssucccffff": [s s u] [c c c] [f f f] [f]
    assert k["density"] == {"bin_size": 3, "used": [3, 0, 0, 0], "shared": [2, 0, 0, 0], "cached": [0, 3, 0, 0]}
    assert [r["id"] for r in snap["running"]] == ["r1"] and snap["running"][0]["block_table"] is None
    assert snap["truncated"] == {"running": 1, "waiting": 0} and k["waste"] is None
    assert k["used_blocks"] == 3  # counts stay exact


def test_large_pool_density():
    kv = KVCacheManager(num_blocks=50_000, block_size=16)
    r = make_request("big", list(range(16 * 100)))
    compute(kv, r, 16 * 100)
    snap = build_snapshot(kv, [r], [], max_cells=65536)
    d = snap["kv"]["density"]
    assert len(snap["kv"]["blocks"]) == 50_000 and len(d["used"]) == 511 and d["bin_size"] == 98
    assert sum(d["used"]) == 100 == snap["kv"]["used_blocks"]


def _out(rid, n_new, ttft=None, e2e=None, finished=False):
    return SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(delta_token_ids=[0] * n_new)],
                           metrics=SimpleNamespace(ttft=ttft, e2e=e2e))


def test_metrics_history():
    h = MetricsHistory(interval_s=1.0, window_s=3.0, latency_window_s=10.0)
    totals = dict(prompt_tokens=0, generation_tokens=0, num_preemptions=0, prefix_cache_queries=0,
                  prefix_cache_hits=0, spec_draft_tokens=0, spec_accepted_tokens=0)
    assert h.due(0.0) and h.close(0.0, totals, 0.0, None, 0, 0, wall_time=1000.0) is None  # baseline only
    assert not h.due(0.5)
    h.record_outputs([_out("a", 1, ttft=0.2), _out("b", 1, ttft=0.4)], 0.5)
    h.record_outputs([_out("a", 2)], 0.7)  # 2 tokens 0.2 s after the last: two ITLs of 0.1 s
    h.record_outputs([_out("b", 1, e2e=1.0, finished=True)], 0.9)
    totals.update(prompt_tokens=30, generation_tokens=5, num_preemptions=1, prefix_cache_queries=30,
                  prefix_cache_hits=12, spec_draft_tokens=4, spec_accepted_tokens=3)
    p = h.close(2.0, totals, 0.25, 0.1, running=1, waiting=2, wall_time=1002.0)
    assert p["t"] == 1002.0 and p["dt"] == 2.0
    assert p["ttft_ms"] == [300.0, 380.0, 398.0]
    assert p["itl_ms"] == [100.0, 340.0, 394.0]  # 0.1, 0.1, 0.4 (b's second token came 0.4 s after its first)
    assert p["e2e_ms"] == [1000.0, 1000.0, 1000.0]
    assert (p["output_tok_s"], p["prompt_tok_s"], p["kv_usage"], p["kv_waste"]) == (2.5, 15.0, 0.25, 0.1)
    assert (p["prefix_hit_rate"], p["preemptions"], p["spec_acceptance"]) == (0.4, 1, 0.75)
    assert (p["running"], p["waiting"]) == (1, 2)
    # observations older than the latency window drop out; no queries or drafts: None, not 0
    p2 = h.close(20.0, totals, 0.0, None, 0, 0, wall_time=1020.0)
    assert p2["ttft_ms"] is None and p2["prefix_hit_rate"] is None and p2["spec_acceptance"] is None
    assert p2["output_tok_s"] == 0.0 and p2["kv_waste"] is None
    assert h.since(1002.0) == [p2] and h.since(None) == [p, p2]
    for i in range(5):
        h.close(21.0 + i, totals, 0.0, None, 0, 0, wall_time=1021.0 + i)
    assert len(h.points) == 3  # window_s / interval_s


def test_metrics_history_counts_http_errors_per_interval():
    h = MetricsHistory(interval_s=1.0, window_s=10.0)
    h.close(0.0, {"generation_tokens": 0}, 0.0, None, 0, 0, wall_time=1000.0)
    p = h.close(1.0, {"generation_tokens": 0}, 0.0, None, 0, 0, wall_time=1001.0)
    assert (p["http_4xx"], p["http_5xx"]) == (0, 0)  # without the server's counts
    h.close(2.0, {"http_4xx": 3, "http_5xx": 0}, 0.0, None, 0, 0, wall_time=1002.0)
    p = h.close(3.0, {"http_4xx": 7, "http_5xx": 1}, 0.0, None, 0, 0, wall_time=1003.0)
    assert (p["http_4xx"], p["http_5xx"]) == (4, 1)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
