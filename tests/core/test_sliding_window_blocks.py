"""The KV manager with a sliding window (vLLM's sliding-window manager): blocks wholly before the window of a
request's next token go back to the pool, with exact block counts and ids; prefix-cache hits before the window are
not referenced; preemption, forks and rejected drafts keep every block a row still reads. No model."""

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager, blocks_needed
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import EOS, add, fake_run, run_to_end


def _sched(window, num_blocks=64, block_size=4, enable_prefix_caching=False, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window=window)
    return Scheduler(SchedulerConfig(**cfg), kv, eos_token_ids=[EOS]), kv


def _held(kv, req):
    return [b for b in kv.req_to_blocks[req.request_id] if b is not None]


def test_shared_window_only_when_every_layer_has_the_same_one():
    assert KVCacheManager.shared_window([8, 8, 8]) == 8
    assert KVCacheManager.shared_window([None, 8]) is None  # a full layer reads every key: keep all blocks
    assert KVCacheManager.shared_window([None, None]) is None
    assert KVCacheManager.shared_window([4, 8]) is None
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, 4, sliding_window=0)


@pytest.mark.parametrize("window, bs, expect", [(8, 4, [0] * 11 + [1]),
                                                (1, 4, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]),
                                                (5, 2, [0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3])])
def test_skipped_blocks_are_those_wholly_before_the_next_tokens_window(window, bs, expect):
    """Position p reads keys p - window < j <= p: block i is done once (i + 1) * bs <= p - window + 1."""
    kv = KVCacheManager(64, bs, sliding_window=window)
    assert [kv.skipped_blocks(p) for p in range(12)] == expect
    for p in range(60):
        n = kv.skipped_blocks(p)
        assert n * bs <= max(0, p - window + 1) < (n + 1) * bs


def test_a_decoding_request_holds_only_its_windows_blocks_and_the_rest_go_back():
    """Window 8, blocks of 4, a 20-token prompt decoding 30 tokens: before each step the request holds exactly
    blocks_needed(total) - skipped_blocks(computed) blocks; its table keeps its length with placeholders."""
    sched, kv = _sched(8)
    req = add(sched, "a", 20, 30)
    so = sched.schedule()
    assert kv.block_pool.num_used_blocks == 5 and kv.get_block_ids(req) == [0, 1, 2, 3, 4]
    sched.update_from_output(so, fake_run(so))
    so = sched.schedule()  # the first decode: position 20 reads keys 13..20, so blocks 0-2 (tokens 0-11) go back
    assert kv.get_block_ids(req) == [NULL_BLOCK_ID] * 3 + [3, 4, 5]
    assert so.scheduled[0].block_ids == kv.get_block_ids(req)
    assert kv.block_pool.num_used_blocks == 3 and [b.block_id for b in _held(kv, req)] == [3, 4, 5]
    kv.check_integrity()
    while sched.has_unfinished_requests():
        sched.update_from_output(so, fake_run(so))
        kv.check_integrity()
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        c = req.num_computed_tokens
        assert len(kv.get_block_ids(req)) == blocks_needed(c + 1, 4)
        assert kv.block_pool.num_used_blocks == blocks_needed(c + 1, 4) - kv.skipped_blocks(c) <= 3
    assert kv.block_pool.num_free_blocks == 64


def test_without_a_window_every_block_is_kept():
    sched, kv = _sched(None)
    req = add(sched, "a", 20, 30)

    def check(so):
        assert kv.block_pool.num_used_blocks == blocks_needed(req.num_computed_tokens + len(so.scheduled[0].token_ids),
                                                              4)
        assert NULL_BLOCK_ID not in kv.get_block_ids(req)[1:]

    run_to_end(sched, kv, check=check)
    assert req.num_computed_tokens == 49 and kv.block_pool.num_free_blocks == 64


def test_a_long_prompt_in_chunks_frees_behind_its_window_between_chunks():
    """A 40-token prompt in chunks of 8 (window 8, blocks of 4): each chunk's first row reads from
    start - 7, so before the chunk at 32 the blocks 0..5 (tokens 0-23) are back in the pool."""
    sched, kv = _sched(8, max_num_batched_tokens=8)
    req = add(sched, "a", 40, 1)
    used = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        used.append((req.num_computed_tokens, kv.block_pool.num_used_blocks))
        sched.update_from_output(so, fake_run(so))
        kv.check_integrity()
    assert used == [(0, 2), (8, 4), (16, 4), (24, 4), (32, 4)]
    assert kv.block_pool.num_free_blocks == 64


def test_prefix_hits_before_the_window_are_not_referenced_and_freed_blocks_stay_cached():
    """Request a (21 tokens) decodes past its window, freeing blocks 0..; they were cached first, so b with the
    same prompt hits all 5 full blocks, references only those its window still reads, and starts after them."""
    sched, kv = _sched(8, enable_prefix_caching=True)
    a = add(sched, "a", 21, 4)
    run_to_end(sched, kv)
    assert len(kv.block_pool.cached) == 6  # 24 tokens computed: 6 full blocks, all in the free queue, hashed
    b = add(sched, "b", 21, 2)
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1, 2, 3, 4]
    so = sched.schedule()  # b's first token to compute is 20: it reads 13..20 -> blocks 3, 4 and a new one
    assert b.num_computed_tokens == 20 and so.scheduled[0].start_pos == 20
    assert kv.get_block_ids(b)[:5] == [NULL_BLOCK_ID] * 3 + [3, 4]
    assert [bl.ref_cnt for bl in kv.block_pool.blocks[:5]] == [0, 0, 0, 1, 1]
    assert kv.prefix_cache_hits == 20
    kv.check_integrity()
    sched.update_from_output(so, fake_run(so))
    run_to_end(sched, kv)
    assert kv.block_pool.num_free_blocks == 64
    del a


def test_preemption_frees_everything_and_the_recompute_frees_again():
    sched, kv = _sched(16, num_blocks=9, max_num_seqs=2)
    reqs = [add(sched, r, 14, 30) for r in "ab"]

    def check(so):
        for s in so.scheduled:  # every block a scheduled row reads (from start_pos - 7 on) is held
            table = kv.req_to_blocks[s.request_id]
            assert all(b is not None for b in table[max(0, s.start_pos - 16 + 1) // 4:])
            assert len(table) == blocks_needed(s.start_pos + len(s.token_ids), 4)

    run_to_end(sched, kv, check=check)
    assert sched.num_preemptions > 0  # two requests at position 16 need 10 blocks
    assert [len(r.output_token_ids) for r in reqs] == [30, 30]
    assert kv.block_pool.num_free_blocks == 9


def test_rejected_drafts_never_need_a_freed_block():
    """Drafts of 4 verified at every step, all rejected or all accepted in turn: the blocks freed before a step
    were chosen from the confirmed count, so after a rollback every block the next token reads is still held."""
    sched, kv = _sched(6, block_size=2)
    req = add(sched, "a", 11, 24)
    step = 0
    while sched.has_unfinished_requests():
        if req.num_uncomputed_tokens == 1:
            sched.update_draft_token_ids({"a": ([7, 7, 7, 7], None)})
        so = sched.schedule()
        c = req.num_computed_tokens
        table = kv.req_to_blocks["a"]
        assert all(table[j] is not None for j in range(kv.skipped_blocks(c), len(table)))
        sched.update_from_output(so, fake_run(so, drafts_accepted={"a": 4 * (step % 2)}))
        kv.check_integrity()
        table = kv.req_to_blocks.get("a", [])
        assert all(table[j] is not None for j in range(kv.skipped_blocks(req.num_computed_tokens), len(table)))
        step += 1
    assert len(req.output_token_ids) == 24 and kv.block_pool.num_free_blocks == 64


def test_forked_samples_share_the_table_placeholders_included():
    """A 9-token prompt in chunks of 4 (window 4, blocks of 2): blocks 0-1 go back before the last chunk, then the
    second sample forks from the table with its placeholders; the shared partial block is copied on write."""
    sched, kv = _sched(4, block_size=2, max_num_batched_tokens=4)
    sp = SamplingParams(n=2, max_tokens=6, ignore_eos=True)
    parent, child = Request("p", list(range(3, 12)), sp, 10**6), Request("p#1", list(range(3, 12)), sp, 10**6)
    parent.fork_children = [child]
    sched.add_request(parent)
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, fake_run(so))
    assert child.num_computed_tokens == 9
    assert kv.get_block_ids(parent) == kv.get_block_ids(child) == [NULL_BLOCK_ID] * 2 + [2, 3, 4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [0, 0, 2, 2, 2]
    kv.check_integrity()
    so = sched.schedule()  # position 9 reads 6..9: blocks 0-2 done; block 4 shared and partial: copied
    assert so.block_copies == [(4, 5)]
    assert [(x.request_id, x.block_ids) for x in so.scheduled] == [
        ("p", [NULL_BLOCK_ID] * 3 + [3, 5]), ("p#1", [NULL_BLOCK_ID] * 3 + [3, 4])]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(6)] == [0, 0, 0, 2, 1, 1]
    sched.update_from_output(so, fake_run(so))
    run_to_end(sched, kv)
    assert len(parent.output_token_ids) == len(child.output_token_ids) == 6 and kv.block_pool.num_free_blocks == 64
