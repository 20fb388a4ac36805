"""Chunked prefill and priority scheduling with a fake model runner (no model): exact chunk sizes and orders."""

from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import add, fake_run, make_sched, run_to_end


def step(sched):
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so))
    return so


def chunks(so):
    return [(s.request_id, s.num_scheduled_tokens) for s in so.scheduled]


def test_long_prompt_is_split_and_decodes_go_first():
    sched, kv = make_sched(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    add(sched, "d1", prompt_len=3, max_tokens=30)
    add(sched, "d2", prompt_len=3, max_tokens=30)
    assert chunks(step(sched)) == [("d1", 3), ("d2", 3)]
    long = add(sched, "long", prompt_len=27, max_tokens=2)
    # decodes (1 each) first, the prompt takes the remaining 6 tokens per step: 6, 6, 6, 6, 3
    seen = []
    while long.num_computed_tokens < 27:
        so = step(sched)
        assert so.total_num_scheduled_tokens <= 8
        assert chunks(so)[:2] == [("d1", 1), ("d2", 1)]  # every running decode gets a token every step
        seen.append(dict(chunks(so))["long"])
        if long.num_computed_tokens < 27:
            assert long.output_token_ids == []  # nothing sampled mid-prefill
    assert seen == [6, 6, 6, 6, 3]
    assert long.output_token_ids == [100]  # sampled exactly when the last chunk completed
    assert kv.get_block_ids(long) == kv.get_block_ids(long)[:7] and len(kv.get_block_ids(long)) == 7
    run_to_end(sched, kv)


def test_chunks_at_block_multiples_and_smaller_than_a_block():
    for budget, expected in ((8, [8, 8, 8]), (3, [3] * 8)):
        sched, kv = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=budget)
        req = add(sched, "p", prompt_len=24, max_tokens=1)
        got = []
        while req.num_computed_tokens < 24:
            so = step(sched)
            got.append(so.scheduled[0].num_scheduled_tokens)
            assert len(so.scheduled[0].block_ids) == -(-req.num_computed_tokens // 4)  # blocks as tokens arrive
        assert got == expected
        assert req.status is RequestStatus.FINISHED_LENGTH
        kv.check_integrity()


def test_several_requests_mid_prefill_at_once():
    sched, kv = make_sched(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    a = add(sched, "a", prompt_len=15, max_tokens=1)
    b = add(sched, "b", prompt_len=15, max_tokens=1)
    assert chunks(step(sched)) == [("a", 10)]
    assert chunks(step(sched)) == [("a", 5), ("b", 5)]
    assert a.output_token_ids == [100] and b.num_computed_tokens == 5 and not b.output_token_ids
    assert chunks(step(sched)) == [("b", 10)]
    assert b.output_token_ids == [100]


def test_unchunked_schedules_prompts_whole():
    sched, kv = make_sched(num_blocks=32, block_size=4, max_num_batched_tokens=10, enable_chunked_prefill=False)
    add(sched, "a", prompt_len=8, max_tokens=2)
    add(sched, "b", prompt_len=8, max_tokens=2)
    assert chunks(step(sched)) == [("a", 8)]  # b does not fit in the 2 tokens left: it waits
    assert chunks(step(sched)) == [("a", 1), ("b", 8)]


def test_priority_admission_order_and_fcfs_ties():
    sched, kv = make_sched(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    order = []
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2), ("high2", 0)):
        r = add(sched, rid, prompt_len=4, max_tokens=1)
        r.priority = prio
        # re-insert with the priority set (add() enqueues with the default 0)
        sched.waiting.remove(r)
        sched._enqueue(r, preempted=False)
    while sched.has_unfinished_requests():
        so = step(sched)
        order += [s.request_id for s in so.scheduled]
    assert order == ["high", "high2", "mid", "low"]


def test_priority_preempts_lowest_priority_first():
    sched, kv = make_sched(num_blocks=6, block_size=4, max_num_seqs=3, scheduling_policy="priority")
    reqs = {}
    for rid, prio in (("p1", 1), ("p9", 9), ("p5", 5)):
        r = Request(rid, list(range(3, 11)), SamplingParams(max_tokens=10, ignore_eos=True), 10**6, priority=prio)
        sched.add_request(r)
        reqs[rid] = r
    so = step(sched)
    assert sorted(chunks(so)) == [("p1", 8), ("p5", 8), ("p9", 8)]
    so = sched.schedule()  # each needs a third block for token 9; 0 free: the lowest priority (p9) goes first
    assert so.preempted[0] == "p9"
    assert reqs["p9"].status is RequestStatus.PREEMPTED
    sched.update_from_output(so, fake_run(so))
    run_to_end(sched, kv)
    assert all(len(r.output_token_ids) == 10 for r in reqs.values())


def test_fcfs_victim_already_scheduled_gives_back_its_budget():
    # a decode request scheduled first in the step is the newest: when the older prefilling request cannot
    # get a block, the decode is unscheduled, preempted, and its token returns to the budget
    sched, kv = make_sched(num_blocks=3, block_size=4, max_num_seqs=2, max_num_batched_tokens=6)
    old = add(sched, "old", prompt_len=10, max_tokens=2)
    assert chunks(step(sched)) == [("old", 6)]
    new = add(sched, "new", prompt_len=2, max_tokens=5)
    sched.running.append(sched.waiting.pop(0))  # force "new" running with one block, as if admitted earlier
    new.status = RequestStatus.RUNNING
    kv.allocate_slots(new, 2)
    new.num_computed_tokens = 2
    new.output_token_ids = [100]
    kv.allocate_slots(new, 1)
    so = sched.schedule()
    assert so.preempted == ["new"]
    assert chunks(so) == [("old", 4)]
    kv.check_integrity()
