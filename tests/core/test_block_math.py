"""Block math and pool invariants, no model (exact block counts and ids)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager, blocks_needed
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def make_req(rid, n_prompt=1, max_tokens=16):
    return Request(str(rid), list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), max_total_tokens=10**6)


def test_blocks_needed_exact():
    assert blocks_needed(8, 4) == 2
    assert blocks_needed(9, 4) == 3
    assert blocks_needed(0, 4) == 0
    assert blocks_needed(1, 16) == 1
    assert blocks_needed(16, 16) == 1
    assert blocks_needed(17, 16) == 2


def test_ninth_token_takes_third_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_req(0, n_prompt=8)
    assert kv.allocate_slots(req, 8) == [0, 1]
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == [2]
    assert kv.get_block_ids(req) == [0, 1, 2]


def test_new_block_iff_len_multiple_of_block_size():
    bs = 4
    kv = KVCacheManager(num_blocks=20, block_size=bs)
    req = make_req(0)
    for n in range(0, 40):
        req.num_computed_tokens = n
        new = kv.allocate_slots(req, 1)
        assert (len(new) == 1) == (n % bs == 0), n
    assert len(kv.get_block_ids(req)) == 10


def test_allocation_failure_returns_none_and_leaves_pool_unchanged():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_req("a"), make_req("b")
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    before = (kv.block_pool.num_free_blocks, kv.get_block_ids(a), dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 5) is None  # needs 2, 1 free
    assert (kv.block_pool.num_free_blocks, kv.get_block_ids(a), dict(kv.req_to_blocks)) == before
    assert "b" not in kv.req_to_blocks
    # a request that already holds blocks keeps them when growing fails
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 8) is None
    assert kv.get_block_ids(a) == [0, 1, 2] and kv.block_pool.num_free_blocks == 1
    kv.check_integrity()


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_req("a")
    assert kv.allocate_slots(a, 6) == [0, 1, 2]
    kv.free(a)
    assert kv.block_pool.num_free_blocks == 6
    kv.check_integrity()
    # freed tail-first, appended to the back of the queue: 3,4,5 first, then 2,1,0
    b = make_req("b")
    assert kv.allocate_slots(b, 12) == [3, 4, 5, 2, 1, 0]


def test_stats_and_waste():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_req("r", n_prompt=5, max_tokens=10)
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    s = kv.stats([r])
    assert (s.used_blocks, s.free_blocks, s.tokens_allocated, s.tokens_stored) == (2, 6, 8, 5)
    assert s.naive_reserved_tokens == 15
    assert s.waste == 3 / 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 5), st.integers(1, 20)),
                max_size=60))
def test_random_allocate_append_free_keeps_invariants(ops):
    bs, nb = 4, 12
    kv = KVCacheManager(num_blocks=nb, block_size=bs)
    reqs = {}
    for op, rid, n in ops:
        req = reqs.get(rid)
        if op == "alloc" and req is None:
            req = make_req(rid)
            if kv.allocate_slots(req, n) is not None:
                req.num_computed_tokens = n
                reqs[rid] = req
        elif op == "append" and req is not None:
            free_before = kv.block_pool.num_free_blocks
            grow = blocks_needed(req.num_computed_tokens + n, bs) - len(kv.get_block_ids(req))
            new = kv.allocate_slots(req, n)
            if new is None:
                assert kv.block_pool.num_free_blocks == free_before and grow > free_before
            else:
                assert len(new) == max(0, grow)
                req.num_computed_tokens += n
        elif op == "free" and req is not None:
            kv.free(req)
            del reqs[rid]
        kv.check_integrity()
        for r in reqs.values():
            assert len(kv.get_block_ids(r)) == blocks_needed(r.num_computed_tokens, bs)
        used = sum(len(kv.get_block_ids(r)) for r in reqs.values())
        assert used + kv.block_pool.num_free_blocks == nb
        ids = [b for r in reqs.values() for b in kv.get_block_ids(r)]
        assert len(ids) == len(set(ids))  # no block in two tables (no sharing yet)
    for r in list(reqs.values()):
        kv.free(r)
    assert kv.block_pool.num_free_blocks == nb
