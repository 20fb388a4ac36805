"""Scheduler with a fake model runner: limits, completion, preemption, continuous vs static. No model."""

from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import add, fake_run, make_sched, run_to_end

def test_limits_hold_and_every_request_finishes():
    sched, kv = make_sched(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=20)
    reqs = [add(sched, i, prompt_len=5 + i % 7, max_tokens=3 + (i * 5) % 11) for i in range(12)]

    def check(so):
        assert len(sched.running) <= 3
        assert len(so.scheduled) <= 3
        assert so.total_num_scheduled_tokens <= 20

    run_to_end(sched, kv, check=check)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [100 + i for i in range(r.sampling_params.max_tokens)]
    assert kv.block_pool.num_free_blocks == 64


def test_prefill_then_one_token_per_decode_step():
    sched, kv = make_sched(max_num_seqs=4)
    r = add(sched, "a", prompt_len=10, max_tokens=3)
    so = sched.schedule()
    assert [(s.request_id, s.num_scheduled_tokens) for s in so.scheduled] == [("a", 10)]
    assert so.scheduled[0].block_ids == [0, 1, 2]
    sched.update_from_output(so, fake_run(so))
    assert r.num_computed_tokens == 10 and r.output_token_ids == [100]
    so = sched.schedule()
    assert so.scheduled[0].num_scheduled_tokens == 1
    assert so.scheduled[0].block_ids == [0, 1, 2]  # token 11 fits in block 2
    sched.update_from_output(so, fake_run(so))
    so = sched.schedule()  # 12 tokens computed, the 12th slot is the last of block 2
    assert so.scheduled[0].block_ids == [0, 1, 2]
    sched.update_from_output(so, fake_run(so))
    assert r.status is RequestStatus.FINISHED_LENGTH and kv.block_pool.num_free_blocks == 64


def test_eos_and_stop_token_ids_respect_min_tokens():
    sched, kv = make_sched()
    req = Request("s", [5, 6], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[101]), 10**6)
    sched.add_request(req)
    run_to_end(sched, kv)
    assert req.output_token_ids == [100, 101]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 101
    sched2, kv2 = make_sched()
    req2 = Request("t", [5, 6], SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[101]), 10**6)
    sched2.add_request(req2)
    run_to_end(sched2, kv2)
    assert len(req2.output_token_ids) == 10  # 101 came before min_tokens: ignored


def test_continuous_takes_fewer_steps_than_static_on_skewed_lengths():
    lengths = [4, 4, 4, 64] * 4  # one long request per group of four
    steps = {}
    for policy in ("continuous", "static"):
        sched, kv = make_sched(num_blocks=256, max_num_seqs=4, scheduling=policy)
        for i, m in enumerate(lengths):
            add(sched, i, prompt_len=6, max_tokens=m)
        steps[policy] = run_to_end(sched, kv)
    # static: 4 batches each bounded by its 64-token request; continuous refills freed slots at once
    assert steps["static"] == 4 * 64
    assert steps["continuous"] < steps["static"] * 0.6


def test_static_admits_only_when_drained():
    sched, kv = make_sched(max_num_seqs=2, scheduling="static")
    add(sched, "a", 4, 2)
    add(sched, "b", 4, 8)
    add(sched, "c", 4, 2)
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled] == ["a", "b"]
    sched.update_from_output(so, fake_run(so))
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so))  # a finishes here
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled] == ["b"]  # c waits for the batch to drain


def test_static_forms_a_whole_batch_beyond_the_token_budget():
    # 4 prompts of 10 tokens, budget 16, chunked: all 4 join the batch at once (their blocks are taken now) and
    # their prefill is paced by the budget: 16 tokens per step, decodes first, no newcomer until the batch drains.
    sched, kv = make_sched(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                           enable_chunked_prefill=True, scheduling="static")
    for i in range(5):
        add(sched, i, prompt_len=10, max_tokens=3)
    so = sched.schedule()
    assert len(sched.running) == 4 and [r.request_id for r in sched.waiting] == ["4"]
    assert [(s.request_id, s.num_scheduled_tokens) for s in so.scheduled] == [("0", 10), ("1", 6)]
    assert kv.block_pool.num_used_blocks == 4 * 3  # every prompt's 3 blocks, taken at admission
    sched.update_from_output(so, fake_run(so))
    so = sched.schedule()
    assert [(s.request_id, s.num_scheduled_tokens) for s in so.scheduled] == [("0", 1), ("1", 4), ("2", 10), ("3", 1)]
    run_to_end(sched, kv)
    assert kv.block_pool.num_free_blocks == 64
    assert kv.prefix_cache_queries == 0  # caching off; and with it on, each prompt is queried once (below)


def test_static_batch_counts_each_prefix_cache_query_once():
    sched, kv = make_sched(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                           enable_chunked_prefill=True, scheduling="static", enable_prefix_caching=True)
    for i in range(4):
        add(sched, i, prompt_len=10, max_tokens=2)
    run_to_end(sched, kv)
    assert kv.prefix_cache_queries == 4 * 10


def test_preemption_by_recompute_when_pool_runs_dry():
    # 6 blocks of 4 tokens; three requests of 8-token prompts growing to 8 + 12 tokens cannot all fit
    sched, kv = make_sched(num_blocks=6, block_size=4, max_num_seqs=3)
    reqs = [add(sched, i, prompt_len=8, max_tokens=12) for i in range(3)]
    seen_recompute = []

    def check(so):
        for s in so.scheduled:
            r = sched.requests[s.request_id]
            if r.num_preemptions and r.num_computed_tokens == 0:
                seen_recompute.append((r.request_id, s.num_scheduled_tokens, r.num_tokens))
        for rid in so.preempted:
            v = next(r for r in reqs if r.request_id == rid)
            assert v.num_computed_tokens == 0 and kv.get_block_ids(v) == []

    run_to_end(sched, kv, check=check)
    assert sched.num_preemptions > 0
    # a resumed request recomputes prompt + generated tokens in one prefill
    assert seen_recompute and all(n == total for _, n, total in seen_recompute)
    for r in reqs:
        assert r.output_token_ids == [100 + i for i in range(12)]
    assert kv.block_pool.num_free_blocks == 6


def test_newest_running_request_is_preempted_first():
    sched, kv = make_sched(num_blocks=4, block_size=4, max_num_seqs=2)
    a = add(sched, "a", prompt_len=8, max_tokens=20)
    b = add(sched, "b", prompt_len=8, max_tokens=20)
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so))
    # both hold 2 blocks; token 9 of "a" needs a third block: "b" (newest) is preempted
    so = sched.schedule()
    assert so.preempted == ["b"]
    assert [s.request_id for s in so.scheduled] == ["a"]
    assert sched.waiting[0] is b and b.status is RequestStatus.PREEMPTED


def test_abort_frees_blocks_wherever_the_request_is():
    sched, kv = make_sched(num_blocks=8, block_size=4, max_num_seqs=1)
    a = add(sched, "a", 8, 5)
    b = add(sched, "b", 8, 5)
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so))
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and kv.block_pool.num_free_blocks == 8
