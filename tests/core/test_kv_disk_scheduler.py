"""The disk tier through the scheduler, with the fake runner: a request whose prefix is on disk waits in
WAITING_FOR_KV_LOAD with exact block ids while others run, its loaded blocks enter the pool and it starts after them
(the last prompt token always computed), an abort while loading leaks nothing, a short read recomputes the rest,
and a second request on the same prefix waits for the first one's load instead of reading it again."""

from concurrent.futures import Future

from kvserve.core.kv_disk_store import DiskBlockStore
from kvserve.core.kv_disk_tier import KVDiskTier, LoadResult
from kvserve.request import RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.request import Request
from tests.core.conftest import fake_run, make_sched

BS = 4
PAYLOAD = 64
FP = bytes(32)


def payload_of(h):
    return (h.value * 2)[:PAYLOAD]


class ManualTier(KVDiskTier):
    """A tier over a real store whose loads finish when the test says (``release``)."""

    def __init__(self, root):
        super().__init__(DiskBlockStore(root, FP, 10**9), PAYLOAD)
        self.pending: list[tuple[list, Future]] = []

    def load(self, hashes):
        fut = Future()
        self.pending.append((list(hashes), fut))
        return fut

    def release(self, i=0, keep=None):
        hashes, fut = self.pending.pop(i)
        payloads = [self.store.get(h, PAYLOAD) for h in hashes][:keep]
        fut.set_result(LoadResult(payloads, 0.0))


def req(rid, tokens, max_tokens=2):
    return Request(str(rid), list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 10**6)


def step(sched, kv, tier=None):
    """One engine step over the fake runner; newly cached blocks are saved as the engine does."""
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so))
    if tier is not None:
        for _, h in kv.take_newly_cached():
            if tier.wants(h):
                tier.save(h, [payload_of(h)])
    kv.check_integrity()
    return so


def new_sched(tier, num_blocks=32):
    sched, kv = make_sched(num_blocks, BS, enable_prefix_caching=True)
    sched.kv_tier = tier
    kv.newly_cached = []
    return sched, kv


def fill_store(tmp_path, tokens):
    """A first 'process' computes ``tokens`` and writes its full blocks."""
    tier = KVDiskTier(DiskBlockStore(tmp_path, FP, 10**9), PAYLOAD)
    sched, kv = new_sched(tier)
    sched.add_request(req("warm", tokens))
    while sched.has_unfinished_requests():
        step(sched, kv, tier)
    tier.close()
    assert tier.stats.blocks_written == (len(tokens) + 2 - 1) // BS  # prompt + output blocks, all but the last


def test_a_restart_loads_the_prefix_and_starts_after_it(tmp_path):
    prompt = list(range(10, 28))  # 18 tokens: 4 full blocks + 2
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    r = req("r", prompt)
    sched.add_request(r)
    so = step(sched, kv, tier)
    assert so.scheduled == [] and r.status is RequestStatus.WAITING_FOR_KV_LOAD
    assert kv.get_block_ids(r) == [0, 1, 2, 3]  # the 4 blocks to load into, from the front of the free queue
    assert sched.num_waiting == 1 and sched.has_unfinished_requests()
    hashes = kv.block_hashes(r)
    tier.release()
    so = step(sched, kv, tier)
    assert [(b, bytes(p)) for b, p in so.kv_loads] == [(i, payload_of(hashes[i])) for i in range(4)]
    [s] = so.scheduled
    assert (s.request_id, s.start_pos, s.token_ids, s.block_ids) == ("r", 16, [26, 27], [0, 1, 2, 3, 4])
    assert [kv.block_pool.lookup(h).block_id for h in hashes] == [0, 1, 2, 3]  # in the pool's map now
    assert kv.prefix_cache_hits == 16 and tier.stats.hits == 4 and tier.stats.lookups == 4
    while sched.has_unfinished_requests():
        step(sched, kv, tier)
    assert kv.block_pool.num_free_blocks == 32


def test_a_full_hit_still_computes_the_last_prompt_token(tmp_path):
    prompt = list(range(10, 26))  # exactly 4 blocks
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    sched.add_request(req("r", prompt))
    step(sched, kv, tier)
    assert len(tier.pending[0][0]) == 3  # blocks 0..2 only
    tier.release()
    so = step(sched, kv, tier)
    [s] = so.scheduled
    assert (s.start_pos, s.token_ids, s.block_ids) == (12, prompt[12:], [0, 1, 2, 3])


def test_other_requests_run_while_one_loads(tmp_path):
    prompt = list(range(10, 28))
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    r, other = req("r", prompt), req("o", range(100, 106), max_tokens=3)
    sched.add_request(r)
    sched.add_request(other)  # queued after r: not held up by its load
    so = step(sched, kv, tier)
    assert [(s.request_id, s.start_pos, s.block_ids) for s in so.scheduled] == [("o", 0, [4, 5])]
    so = step(sched, kv, tier)
    assert [s.request_id for s in so.scheduled] == ["o"] and r.status is RequestStatus.WAITING_FOR_KV_LOAD
    tier.release()
    so = step(sched, kv, tier)
    assert [(s.request_id, s.start_pos) for s in so.scheduled] == [("o", 7), ("r", 16)]


def test_an_abort_while_loading_leaks_nothing(tmp_path):
    prompt = list(range(10, 28))
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    r = req("r", prompt)
    sched.add_request(r)
    step(sched, kv, tier)
    assert kv.block_pool.num_free_blocks == 28
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    kv.check_integrity()
    assert kv.block_pool.num_free_blocks == 32 and not sched.has_unfinished_requests()
    assert r.status is RequestStatus.FINISHED_ABORTED
    tier.release()  # the read finishes later: discarded, nothing copied or cached
    so = step(sched, kv, tier)
    assert so.kv_loads == [] and kv.block_pool.cached == {}
    assert kv.block_pool.num_free_blocks == 32


def test_a_short_read_recomputes_the_rest(tmp_path):
    prompt = list(range(10, 28))
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    sched.add_request(req("r", prompt))
    step(sched, kv, tier)
    tier.release(keep=2)  # e.g. the third entry was corrupted
    so = step(sched, kv, tier)
    assert [b for b, _ in so.kv_loads] == [0, 1]
    [s] = so.scheduled
    # the two unused blocks were freed uncached, to the back of the free queue
    assert (s.start_pos, s.token_ids, s.block_ids) == (8, prompt[8:], [0, 1, 4, 5, 6])
    assert kv.block_pool.blocks[2].block_hash is None and kv.block_pool.blocks[3].block_hash is None
    assert tier.stats.hits == 2 and tier.stats.misses == 2


def test_a_second_request_on_the_same_prefix_waits_for_the_first_load(tmp_path):
    prompt = list(range(10, 28))
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    a, b = req("a", prompt), req("b", prompt[:16] + [99, 98, 97])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, kv, tier)
    assert len(tier.pending) == 1 and b.status is RequestStatus.WAITING_FOR_KV_LOAD
    assert kv.get_block_ids(a) == [0, 1, 2, 3] and kv.get_block_ids(b) == []  # b reserved nothing
    tier.release()
    so = step(sched, kv, tier)
    assert [(s.request_id, s.start_pos, s.block_ids) for s in so.scheduled] == [
        ("a", 16, [0, 1, 2, 3, 4]), ("b", 16, [0, 1, 2, 3, 5])]
    assert tier.stats.hits == 4 and tier.stats.lookups == 4 and not tier.pending


def test_a_failed_read_is_a_miss(tmp_path, caplog):
    prompt = list(range(10, 28))
    fill_store(tmp_path, prompt)
    tier = ManualTier(tmp_path)
    sched, kv = new_sched(tier)
    sched.add_request(req("r", prompt))
    step(sched, kv, tier)
    _, fut = tier.pending.pop()
    fut.set_exception(MemoryError("no room for the read"))
    so = step(sched, kv, tier)  # logged, not raised; the request computes everything
    assert so.kv_loads == [] and [(s.start_pos, len(s.token_ids)) for s in so.scheduled] == [(0, 18)]
    assert "loading the blocks of request r failed" in caplog.text
    while sched.has_unfinished_requests():
        step(sched, kv, tier)
    assert kv.block_pool.num_free_blocks == 32
