"""Prefix caching without a model: exact block ids, hits, misses, LRU eviction, the full-hit cap, collisions."""

from kvserve.core.block_pool import BlockHash, BlockPool, hash_block
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import fake_run, make_sched, run_to_end


def req(rid, tokens, max_tokens=1):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 10**6)


def admit_and_compute(kv, r):
    """Admission as the scheduler does it, then mark every token computed and cache the full blocks."""
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, hits) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return [b.block_id for b in hits]


def test_hit_miss_and_partial_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))  # blocks 0,1 full, 2 partial
    assert admit_and_compute(kv, a) == []
    assert kv.get_block_ids(a) == [0, 1, 2]
    assert set(kv.block_pool.cached) == {h.value for h in a.block_hashes[:2]}  # the partial block is not cached
    kv.free(a)  # tail first: the free queue ends ... 2, 1, 0
    b = req("b", list(range(8)) + [99, 98, 97])
    assert admit_and_compute(kv, b) == [0, 1]  # two full blocks hit
    assert kv.get_block_ids(b) == [0, 1, 3]  # the new block comes from the front of the free queue
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 10 + 11
    c = req("c", [1000] + list(range(1, 10)))  # first token differs: the chain misses from block 0
    assert admit_and_compute(kv, c) == []
    d = req("d", list(range(7)))  # only block 0 is full: hits block 0, block 1 (partial) is computed
    assert admit_and_compute(kv, d) == [0]
    kv.check_integrity()


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(9)))
    admit_and_compute(kv, a)
    b = req("b", list(range(9)))
    assert admit_and_compute(kv, b) == [0, 1]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert pool.num_used_blocks == 4  # shared blocks counted once
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    kv.free(b)
    assert pool.num_free_blocks == 8
    kv.check_integrity()


def test_full_hit_is_capped_so_the_last_token_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))  # an exact multiple of block_size
    admit_and_compute(kv, a)
    kv.free(a)
    b = req("b", list(range(8)))
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0]  # block 1 is recomputed, so the last token gets logits
    assert kv.allocate_slots(b, 4, hits) is not None


def test_lru_eviction_order_and_hash_removed_on_reuse():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0,1 full + 2 partial
    admit_and_compute(kv, a)
    kv.free(a)  # free queue: 3, 2, 1, 0  (tail first)
    pool = kv.block_pool
    assert list(pool._free) == [3, 2, 1, 0]
    b = req("b", [9, 9, 9])  # needs 2 blocks: takes 3 then 2 (2 was partial, never cached)
    admit_and_compute(kv, b)
    assert kv.get_block_ids(b) == [3, 2] and pool.num_evictions == 0
    c = req("c", [7, 7, 7])  # needs 2 blocks: takes 1 then 0, evicting a's cached blocks, LRU first
    admit_and_compute(kv, c)
    assert kv.get_block_ids(c) == [1, 0] and pool.num_evictions == 2
    # a freed block reused by another prompt never serves the first prompt again
    a2 = req("a2", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(a2) == []
    assert a.block_hashes[0].value not in pool.cached
    kv.check_integrity()


def test_hit_on_a_free_cached_block_takes_it_out_of_the_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    admit_and_compute(kv, a)
    kv.free(a)
    b = req("b", [1, 2, 8])
    assert admit_and_compute(kv, b) == [0]
    assert 0 not in kv.block_pool._free and kv.block_pool.blocks[0].ref_cnt == 1
    # the new block is not the cached one: allocation counts the reclaimed hit
    assert kv.get_block_ids(b) == [0, 2]  # queue was 2, 3, 1, 0


def test_allocation_failure_with_hits_leaves_everything_unchanged():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3, 4])
    admit_and_compute(kv, a)  # blocks 0,1; block 0 cached, block 1 recomputed on a full hit
    kv.free(a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8])  # hits block 0 and 1, needs 2 more: only 1 left after reclaim
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    before = (list(kv.block_pool._free), [bl.ref_cnt for bl in kv.block_pool.blocks])
    assert kv.allocate_slots(b, 4, hits) is None
    assert (list(kv.block_pool._free), [bl.ref_cnt for bl in kv.block_pool.blocks]) == before
    assert "b" not in kv.req_to_blocks


def test_collision_never_serves_wrong_blocks():
    pool = BlockPool(2)
    [blk] = pool.get_new_blocks(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(blk, h)
    assert pool.lookup(h) is blk
    forged = BlockHash(h.value, h.parent, (5, 6, 7, 8))  # same hash value, other tokens
    assert pool.lookup(forged) is None
    assert pool.lookup(BlockHash(h.value, b"other parent", h.token_ids)) is None
    assert hash_block(None, [1, 2, 3, 4], extra_keys=("lora-1",)).value != h.value
    assert hash_block(h, [1, 2, 3, 4]).value != h.value  # chained on the parent


def test_preempted_request_hits_its_own_blocks_on_resume():
    sched, kv = make_sched(num_blocks=6, block_size=4, max_num_seqs=3, enable_prefix_caching=True)
    reqs = []
    for i in range(3):
        r = Request(str(i), [50 + i] * 8, SamplingParams(max_tokens=12, ignore_eos=True), 10**6)
        sched.add_request(r)
        reqs.append(r)
    run_to_end(sched, kv)
    assert sched.num_preemptions > 0
    assert kv.prefix_cache_hits > 0  # resumed requests found their own cached blocks
    for r in reqs:
        assert r.output_token_ids == [100 + i for i in range(12)]
    assert kv.block_pool.num_free_blocks == 6


def test_scheduler_starts_after_the_hit():
    sched, kv = make_sched(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1), 10**6)
    sched.add_request(a)
    run_to_end(sched, kv)
    b = Request("b", list(range(10)), SamplingParams(max_tokens=1), 10**6)
    sched.add_request(b)
    so = sched.schedule()
    assert [(s.request_id, s.num_scheduled_tokens) for s in so.scheduled] == [("b", 2)]
    assert b.num_computed_tokens == 8
    sched.update_from_output(so, fake_run(so))


def test_fork_shares_blocks_and_copy_on_write_gives_a_private_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = req("p", list(range(10)))  # blocks 0, 1 full; block 2 holds 2 of 4 tokens
    admit_and_compute(kv, parent)
    child = req("c", list(range(10)))
    child.num_computed_tokens = 10
    kv.fork(parent, child)
    pool = kv.block_pool
    assert kv.get_block_ids(child) == [0, 1, 2] and [pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 2]
    assert pool.num_used_blocks == 3  # shared blocks counted once
    assert kv.stats([parent, child]).tokens_stored == 10  # and their tokens too
    # the child writes token 11 into the shared partial block 2: copy-on-write
    assert kv.allocate_slots(child, 1) == []
    assert kv.get_block_ids(child) == [0, 1, 3]
    assert kv.take_pending_copies() == [(2, 3)]
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # the parent is now the only holder of block 2: it writes in place
    assert kv.allocate_slots(parent, 1) == [] and kv.get_block_ids(parent) == [0, 1, 2]
    assert kv.take_pending_copies() == []
    # full shared blocks are never copied: a fork at a block boundary writes into a fresh block
    p2 = req("p2", list(range(50, 58)))
    admit_and_compute(kv, p2)
    c2 = req("c2", list(range(50, 58)))
    c2.num_computed_tokens = 8
    kv.fork(p2, c2)
    assert kv.allocate_slots(c2, 1) == [6] and kv.take_pending_copies() == []
    for r in (parent, child, p2, c2):
        kv.free(r)
    assert pool.num_free_blocks == 8
    kv.check_integrity()


def test_copy_on_write_failure_leaves_everything_unchanged():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent = req("p", list(range(10)))
    admit_and_compute(kv, parent)
    child = req("c", list(range(10)))
    child.num_computed_tokens = 10
    kv.fork(parent, child)
    kv.block_pool.get_new_blocks(0)
    assert kv.block_pool.num_free_blocks == 0
    assert kv.allocate_slots(child, 1) is None
    assert kv.get_block_ids(child) == [0, 1, 2] and kv.take_pending_copies() == []
