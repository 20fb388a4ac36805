"""The one flat-batch builder: exact tensors for a plan mixing decodes, a prompt chunk and a draft span."""

import pytest
import torch

from kvserve.core.sched_output import ScheduledRequest
from kvserve.sample.state import SamplingState
from kvserve.sampling_params import SamplingParams
from kvserve.batch import build_input_batch


def state(rid):
    return SamplingState(rid, SamplingParams(), [], [])


def test_mixed_plan_gives_exact_tensors():
    plan = [
        ScheduledRequest("dec", [11], 5, [3, 7], samples=True, sampling_states=[state("dec")]),
        ScheduledRequest("chunk", [20, 21, 22], 4, [1, 2]),  # positions 4..6 of a longer prompt: no sampling
        ScheduledRequest("spec", [30, 31, 32], 2, [5, 6], spec_token_ids=[31, 32], samples=True,
                         sampling_states=[state("spec")]),
        ScheduledRequest("fork", [40], 0, [9], samples=True, sampling_states=[state("fork"), state("fork#1")]),
    ]
    b = build_input_batch(plan, block_size=4)
    assert b.input_ids.tolist() == [11, 20, 21, 22, 30, 31, 32, 40]
    assert b.positions.tolist() == [5, 4, 5, 6, 2, 3, 4, 0]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert b.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0,
                                       9 * 4 + 0]
    assert b.query_start_loc.tolist() == [0, 1, 4, 7, 8]
    assert b.seq_lens.tolist() == [6, 7, 5, 1]
    assert b.block_tables.tolist() == [[3, 7], [1, 2], [5, 6], [9, 0]]
    # decode: its row; chunk: none; 2 drafts: 3 rows (k + 1); the fork's 2 samples both read row 7
    assert b.logits_indices.tolist() == [0, 4, 5, 6, 7, 7]
    # the layout the runner reads: "dec" sample 0 on row 0, "spec" verifies on rows 1..3, the fork's samples rows 4, 5
    lay = b.logits_layout
    assert (lay.sample_rows, lay.verify_rows, lay.num_sampling_rows) == (((0, 0, 0), (3, 0, 4), (3, 1, 5)), ((2, 1),), 6)
    assert (b.query_lens, b.context_lens, b.num_tokens, b.num_reqs) == ([1, 3, 3, 1], [6, 7, 5, 1], 8, 4)
    assert all(t.dtype == torch.long for t in (b.input_ids, b.positions, b.slot_mapping, b.block_tables))


def test_pure_decode_plan_gives_exact_tensors():
    """One token per request (the builder's one-pass path): decodes at a block's first and last slot, in a later
    block, a fork whose two samples read one row, and a request that feeds a token without sampling."""
    plan = [
        ScheduledRequest("edge", [11], 4, [3, 7], samples=True, sampling_states=[state("edge")]),  # slot 0 of block 7
        ScheduledRequest("last", [12], 3, [5], samples=True, sampling_states=[state("last")]),  # slot 3 of block 5
        ScheduledRequest("fork", [13], 9, [2, 0, 8], samples=True, sampling_states=[state("fork"), state("fork#1")]),
        ScheduledRequest("quiet", [14], 1, [6]),
    ]
    b = build_input_batch(plan, block_size=4)
    assert b.input_ids.tolist() == [11, 12, 13, 14]
    assert b.positions.tolist() == [4, 3, 9, 1]
    assert b.slot_mapping.tolist() == [7 * 4 + 0, 5 * 4 + 3, 8 * 4 + 1, 6 * 4 + 1]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert b.seq_lens.tolist() == [5, 4, 10, 2]
    assert b.block_tables.tolist() == [[3, 7, 0], [5, 0, 0], [2, 0, 8], [6, 0, 0]]
    assert b.logits_indices.tolist() == [0, 1, 2, 2]
    assert (b.query_lens, b.context_lens, b.num_tokens, b.num_reqs) == ([1, 1, 1, 1], [5, 4, 10, 2], 4, 4)
    assert not b.logits_rows_are_all()  # the fork reads row 2 twice, "quiet" samples nothing
    every = build_input_batch(plan[:2], block_size=4)  # each row samples once, in order: the forward skips a gather
    assert every.logits_indices.tolist() == [0, 1] and every.logits_rows_are_all()
    every.logits_indices = torch.tensor([0, 1])  # replaced (as prompt-logprob rows do): the same values, not known
    assert not every.logits_rows_are_all()
    with pytest.raises(ValueError, match="entry 1: 1 blocks cannot hold 5 tokens"):
        build_input_batch([plan[1], ScheduledRequest("x", [1], 4, [0])], block_size=4)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        build_input_batch([ScheduledRequest("x", [], 0, [0])], block_size=4)
    with pytest.raises(ValueError, match="1 blocks cannot hold 5 tokens"):
        build_input_batch([ScheduledRequest("x", [1, 2], 3, [0])], block_size=4)


def test_persistent_step_buffers_are_reused_and_equal_fresh_tensors():
    """The runner's StepBuffers: the same storage step after step (grown only for a larger step), same values as
    freshly built tensors, contiguous views of the step's shapes."""
    from kvserve.batch import StepBuffers

    bufs = StepBuffers()
    big = [ScheduledRequest(f"r{i}", [i, i + 1], 3 * i, [i, i + 1, 9], samples=True, sampling_states=[state(f"r{i}")])
           for i in range(4)]
    small = [ScheduledRequest("d", [5], 6, [2, 4], samples=True, sampling_states=[state("d")])]
    first = build_input_batch(big, block_size=4, buffers=bufs)
    ptrs = {k: getattr(first, k).data_ptr() for k in ("input_ids", "positions", "slot_mapping", "block_tables")}
    for plan in (small, big, small):
        got, fresh = build_input_batch(plan, block_size=4, buffers=bufs), build_input_batch(plan, block_size=4)
        for k in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                  "logits_indices"):
            t = getattr(got, k)
            assert t.is_contiguous() and torch.equal(t, getattr(fresh, k)), k
        assert {k: getattr(got, k).data_ptr() for k in ptrs} == ptrs  # no new tensors
