"""The scheduler's speculative path and the n > 1 fork, driven by a fake runner: exact plans, computed-token
counts and block tables after every step, and the pool's integrity invariants (no model)."""

from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.core.conftest import add, fake_run, make_sched


def step(sched, kv, accepted=None):
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so, drafts_accepted=accepted))
    kv.check_integrity()
    return so


def test_drafts_are_verified_then_rejected_ones_rolled_back():
    sched, kv = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    a = add(sched, "a", prompt_len=6, max_tokens=20)
    step(sched, kv)  # prefill: 6 tokens, blocks [0, 1], first token 100
    assert (a.num_computed_tokens, a.output_token_ids, kv.get_block_ids(a)) == (6, [100], [0, 1])

    sched.update_draft_token_ids({"a": ([50, 51, 52], None)})
    so = sched.schedule()
    (s,) = so.scheduled
    # the last sampled token + 3 drafts at positions 6..9: a third block for positions 8, 9
    assert (s.token_ids, s.start_pos, s.block_ids, s.spec_token_ids, s.samples) == ([100, 50, 51, 52], 6, [0, 1, 2],
                                                                                  [50, 51, 52], True)
    assert [st.request_id for st in s.sampling_states] == ["a"]
    sched.update_from_output(so, fake_run(so, drafts_accepted={"a": 1}))  # draft 50 accepted, then the bonus 100 + 1 + 1
    kv.check_integrity()
    # 10 computed - 2 rejected = 8 (the bonus token 102 is not computed yet); block 2 held only rejected drafts
    assert (a.num_computed_tokens, a.output_token_ids, kv.get_block_ids(a)) == (8, [100, 50, 102], [0, 1])
    assert kv.block_pool.num_free_blocks == 14

    sched.update_draft_token_ids({"a": ([60, 61], None)})
    so = step(sched, kv)  # both accepted: 102, 60, 61 at positions 8..10, bonus 100 + 3 + 2
    assert so.scheduled[0].token_ids == [102, 60, 61]
    # the freed block 2 went to the tail of the free queue (LRU order): the next new block is 3
    assert (a.num_computed_tokens, a.output_token_ids[3:], kv.get_block_ids(a)) == (11, [60, 61, 105], [0, 1, 3])


def test_drafts_are_truncated_at_the_token_budget_and_dropped_on_preemption():
    sched, kv = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=3)
    a = add(sched, "a", prompt_len=3, max_tokens=20)
    step(sched, kv)
    sched.update_draft_token_ids({"a": ([7, 8, 9, 10], None)})
    so = sched.schedule()
    assert so.scheduled[0].token_ids == [100, 7, 8] and so.scheduled[0].spec_token_ids == [7, 8]
    sched.update_from_output(so, fake_run(so, drafts_accepted={"a": 0}))  # nothing accepted: one recovered token
    assert (a.num_computed_tokens, a.output_token_ids, kv.get_block_ids(a)) == (4, [100, 101], [0])  # 4 fit in one
    kv.check_integrity()

    # a request preempted while holding drafts comes back without them
    sched2, kv2 = make_sched(num_blocks=4, block_size=4, max_num_seqs=2)
    x = add(sched2, "x", prompt_len=8, max_tokens=20)
    y = add(sched2, "y", prompt_len=8, max_tokens=20)
    step(sched2, kv2)
    sched2.update_draft_token_ids({"y": ([1, 2], None)})
    so = sched2.schedule()  # x's token 9 needs a third block: y (newest) is preempted, drafts and all
    assert so.preempted == ["y"] and y.status is RequestStatus.PREEMPTED
    # y's blocks [2, 3] were freed tail first, so block 3 is the first to be reused
    assert [s.request_id for s in so.scheduled] == ["x"] and kv2.get_block_ids(x) == [0, 1, 3]
    sched2.update_from_output(so, fake_run(so))
    sched2.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # room for y again
    plans = [step(sched2, kv2).scheduled for _ in range(3)]  # y's prompt + output recomputed, then decodes
    assert [(p.request_id, p.spec_token_ids) for ss in plans for p in ss] == [("y", []), ("y", []), ("y", [])]


def test_stop_inside_accepted_drafts_drops_the_rest():
    sched, kv = make_sched(num_blocks=16, block_size=4)
    a = add(sched, "a", prompt_len=5, max_tokens=3)
    step(sched, kv)
    sched.update_draft_token_ids({"a": ([40, 41, 42], None)})
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so, drafts_accepted={"a": 3}))  # 4 tokens offered, max_tokens=3 keeps 2 more
    assert a.output_token_ids == [100, 40, 41] and a.status is RequestStatus.FINISHED_LENGTH
    assert kv.block_pool.num_free_blocks == 16
    kv.check_integrity()


def test_parallel_samples_fork_and_copy_on_write():
    sched, kv = make_sched(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sp = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    parent = Request("p", list(range(3, 9)), sp, 10**6)
    child = Request("p#1", list(range(3, 9)), sp, 10**6)
    parent.fork_children = [child]
    sched.add_request(parent)

    so = sched.schedule()
    (s,) = so.scheduled
    assert [st.request_id for st in s.sampling_states] == ["p", "p#1"]  # both draw from the prompt's logits
    out = ModelRunnerOutput(sampled_token_ids={"p": [100], "p#1": [200]})
    updated = sched.update_from_output(so, out)
    kv.check_integrity()
    assert [r.request_id for r in updated] == ["p", "p#1"]
    assert parent.output_token_ids == [100] and child.output_token_ids == [200]
    assert kv.get_block_ids(parent) == kv.get_block_ids(child) == [0, 1]  # shared: block 1 has ref_cnt 2
    assert kv.block_pool.blocks[1].ref_cnt == 2 and child.num_computed_tokens == 6

    so = sched.schedule()  # both write position 6 into shared block 1: the first writer copies it
    assert so.block_copies == [(1, 2)]
    assert [(x.request_id, x.block_ids) for x in so.scheduled] == [("p", [0, 2]), ("p#1", [0, 1])]
    sched.update_from_output(so, fake_run(so))
    kv.check_integrity()
    assert parent.output_token_ids == [100, 101] and child.output_token_ids == [200, 101]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
