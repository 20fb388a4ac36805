"""The routers of ``kvserve.distributed.router``: exact choices, no Ray."""

import pytest

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.distributed.router import (LeastLoadedRouter, PrefixAwareRouter, ReplicaLoad, RoundRobinRouter,
                                        imbalance, least_loaded, make_router, prompt_block_hashes)
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def idle(*ids):
    return {r: ReplicaLoad() for r in ids}


def test_block_hashes_are_the_kv_managers():
    tokens = list(range(100, 111))  # 2 full blocks of 4 and 3 tokens left over
    req = Request("r", tokens, SamplingParams(max_tokens=1), 64)
    expected = [h.value for h in KVCacheManager(8, BS, True).block_hashes(req)]
    assert prompt_block_hashes(tokens, BS) == expected
    assert len(expected) == 2
    assert prompt_block_hashes(tokens[:3], BS) == []
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes(tokens, 0)


def test_round_robin_cycles_in_id_order_and_skips_gone_replicas():
    r = RoundRobinRouter()
    assert [r.choose([], idle(0, 1, 2)) for _ in range(4)] == [0, 1, 2, 0]
    assert r.choose([], idle(0, 2)) == 2  # after 0 comes 1, which is gone
    assert r.choose([], idle(0, 2)) == 0


def test_least_loaded_by_load_then_kv_usage_then_id():
    loads = {0: ReplicaLoad(2, 1, 0.1), 1: ReplicaLoad(1, 0, 0.5), 2: ReplicaLoad(2, 0, 0.2)}
    assert least_loaded(loads) == 1
    loads[1] = ReplicaLoad(1, 1, 0.5)
    assert LeastLoadedRouter().choose([], loads) == 2  # load 2 each: the lower KV usage
    assert least_loaded({5: ReplicaLoad(), 3: ReplicaLoad()}) == 3
    with pytest.raises(ValueError, match="no replicas"):
        least_loaded({})


def test_prefix_follows_the_longest_cached_run():
    r = PrefixAwareRouter()
    a, b = prompt_block_hashes(list(range(16)), BS), prompt_block_hashes(list(range(50, 66)), BS)
    assert r.choose(a, idle(0, 1)) == 0  # nothing cached: least loaded (lowest id)
    r.on_routed(0, a[:2])
    r.on_routed(1, a[:3])
    r.on_routed(1, b)
    assert r.match_length(0, a) == 2 and r.match_length(1, a) == 3
    assert r.choose(a, idle(0, 1)) == 1
    # a replica that holds a later block but not the first one has no usable hit
    assert r.match_length(0, b[1:]) == 0
    loads = {0: ReplicaLoad(0, 0), 1: ReplicaLoad(2, 0)}
    assert r.choose(b, loads) == 1  # a hit within the bound beats an idle replica
    assert r.choose(prompt_block_hashes(list(range(200, 216)), BS), loads) == 0  # no hit: least loaded
    assert (r.num_prefix_routed, r.num_fallback_routed, r.num_overridden) == (2, 2, 0)


def test_prefix_hit_must_cover_a_share_of_the_prompt():
    r = PrefixAwareRouter(min_match_ratio=0.5)
    shared = list(range(8))  # a 2-block "system prompt" every request starts with
    r.on_routed(1, prompt_block_hashes(shared + list(range(100, 116)), BS))
    loads = {0: ReplicaLoad(0, 0), 1: ReplicaLoad(1, 0)}
    assert r.choose(prompt_block_hashes(shared + list(range(200, 216)), BS), loads) == 0  # 2 of 6 blocks: < half
    assert r.choose(prompt_block_hashes(shared + list(range(100, 112)), BS), loads) == 1  # 5 of 5
    assert r.choose(prompt_block_hashes(shared + list(range(100, 104)) + list(range(300, 308)), BS), loads) == 1
    with pytest.raises(ValueError, match="min_match_ratio"):
        PrefixAwareRouter(min_match_ratio=1.5)


def test_prefix_imbalance_bound_and_kv_limit():
    r = PrefixAwareRouter(balance_abs=4, balance_rel=2.0, kv_usage_limit=0.9)
    h = prompt_block_hashes(list(range(8)), BS)
    r.on_routed(1, h)
    # 1 has the hit; overridden only when its load exceeds the lowest by > 4 AND is > 2x it
    assert r.choose(h, {0: ReplicaLoad(0, 0), 1: ReplicaLoad(3, 1)}) == 1  # +4: within
    assert r.choose(h, {0: ReplicaLoad(0, 0), 1: ReplicaLoad(3, 2)}) == 0  # +5 and > 2x 0
    assert r.choose(h, {0: ReplicaLoad(6, 0), 1: ReplicaLoad(8, 3)}) == 1  # +5 but 11 < 2 x 6
    assert r.choose(h, {0: ReplicaLoad(6, 0), 1: ReplicaLoad(6, 0, 0.95)}) == 0  # KV nearly full
    assert (r.num_prefix_routed, r.num_overridden) == (2, 2)


def test_prefix_cache_model_is_lru_and_forgets_removed_replicas():
    r = PrefixAwareRouter(cache_blocks=3)
    a = prompt_block_hashes(list(range(12)), BS)  # 3 blocks
    b = prompt_block_hashes(list(range(100, 108)), BS)  # 2 blocks
    r.on_routed(0, a)
    r.on_routed(0, b)  # 5 > 3: the oldest go, a's tail first (its leading block was refreshed last)
    assert r.match_length(0, b) == 2
    assert r.match_length(0, a) == 1
    r.remove_replica(0)
    assert r.match_length(0, b) == 0
    assert r.choose(b, idle(0, 1)) == 0


def test_make_router_and_bad_bounds():
    assert isinstance(make_router("prefix", balance_abs=2), PrefixAwareRouter)
    assert isinstance(make_router("round-robin"), RoundRobinRouter)
    with pytest.raises(ValueError, match="router must be one of prefix, least-loaded, round-robin"):
        make_router("random")
    with pytest.raises(ValueError, match="balance_rel"):
        PrefixAwareRouter(balance_rel=0.5)
    with pytest.raises(ValueError, match="kv_usage_limit"):
        PrefixAwareRouter(kv_usage_limit=0)
    assert imbalance([2, 2, 2]) == 1.0 and imbalance([4, 0]) == 2.0 and imbalance([0, 0]) is None


@pytest.mark.ray
def test_ray_router_sizes_the_prefix_cache_model_to_the_smallest_reported_pool():
    """The Ray request router models each replica's prefix cache as large as its KV pool (the ``num_blocks`` the
    replicas report in their routing stats); an explicit ``cache_blocks`` wins; no stats yet: unbounded."""
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from kvserve.entrypoints.ray.router import KVServeRequestRouter

    def replicas(*sizes):
        return [SimpleNamespace(routing_stats={"num_blocks": n} if n else {}) for n in sizes]

    router = KVServeRequestRouter.__new__(KVServeRequestRouter)  # no Serve controller: only the policy state
    router.initialize_state(router="prefix", block_size=BS, deployment="test-sizing")
    unbounded = router.policy.cache_blocks
    router._size_prefix_cache(replicas(512, None))
    assert router.policy.cache_blocks == unbounded  # a replica without stats yet: keep the model unbounded
    router._size_prefix_cache(replicas(512, 300))
    assert router.policy.cache_blocks == 300
    fixed = KVServeRequestRouter.__new__(KVServeRequestRouter)
    fixed.initialize_state(router="prefix", block_size=BS, deployment="test-sizing-fixed", cache_blocks=64)
    fixed._size_prefix_cache(replicas(512, 300))
    assert fixed.policy.cache_blocks == 64
