"""``kvserve.lab`` on the real components: the seeds' boundary cases, with exact values."""

import pytest
import torch

from examples import lab
from kvserve.core.kv_cache_manager import KVCacheManager
from examples.lab import (BlockManager, blocks_needed, continuous_batching_steps, kv_cache_blocks_fragmentation,
                         speculative_accept, static_batching_steps)
from tests.spec_decode.stats import chi_square


def test_blocks_needed_is_the_engines():
    from kvserve.core import kv_cache_manager

    assert lab.blocks_needed is kv_cache_manager.blocks_needed
    assert blocks_needed(8, 4) == 2
    assert blocks_needed(9, 4) == 3
    assert blocks_needed(0, 4) == 0
    assert blocks_needed(1, 16) == 1


def test_block_manager_ninth_token_takes_the_third_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert isinstance(bm.kv_cache_manager, KVCacheManager)  # a facade over the real manager
    assert bm.allocate("a", 8) == [0, 1]
    assert bm.append("a") == [2]  # length 8 is a multiple of 4: the 9th token needs a new block
    assert bm.append("a") == []  # the 10th fits in block 2
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_tokens("a") == 10
    assert bm.num_free_blocks == 1
    bm.kv_cache_manager.check_integrity()


def test_block_manager_out_of_blocks_allocates_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 12) == [0, 1, 2]
    assert bm.allocate("b", 5) is None  # needs 2 blocks, 1 free: nothing half-allocated
    assert bm.num_free_blocks == 1
    with pytest.raises(ValueError, match="'b' is not allocated"):
        bm.block_table("b")
    assert bm.allocate("b", 4) == [3]
    assert bm.append("b") is None  # the 5th token needs a block; none left; b is unchanged
    assert bm.num_tokens("b") == 4 and bm.block_table("b") == [3]
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.append("b") == [2]  # a was freed tail first, so its last block is reused first (LRU order)
    bm.kv_cache_manager.check_integrity()


def test_block_manager_bad_input():
    bm = BlockManager(2, 4)
    bm.allocate(1, 0)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, 3)
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
        bm.allocate(2, -1)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(2, 0)


def test_fragmentation_exact():
    f = kv_cache_blocks_fragmentation([5, 17, 33, 64], max_len=128, block_size=16)
    assert (f.used, f.paged_slots, f.paged_waste, f.naive_slots, f.naive_waste) == (119, 160, 41, 512, 393)
    assert f.paged_waste_fraction == pytest.approx(41 / 160)
    assert f.naive_waste_fraction == pytest.approx(393 / 512)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_waste_at_most_block_size_minus_one_per_sequence(block_size):
    lens = list(range(0, 70))
    f = kv_cache_blocks_fragmentation(lens, max_len=70, block_size=block_size)
    per_seq = [kv_cache_blocks_fragmentation([n], 70, block_size).paged_waste for n in lens]
    assert max(per_seq) == block_size - 1 and min(per_seq) == 0
    assert f.paged_waste == sum(per_seq) <= (block_size - 1) * len(lens)
    assert f.naive_waste == 70 * len(lens) - sum(lens)


def test_fragmentation_bad_input_names_the_field():
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be an integer in \[0, 8\]"):
        kv_cache_blocks_fragmentation([1, 9], max_len=8, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_blocks_fragmentation([1], 8, 0)


def test_static_wastes_slot_steps_on_a_skewed_batch_continuous_none():
    skewed = [1, 1, 1, 8, 1, 1, 1, 8]
    s = static_batching_steps(skewed, max_batch=4)
    # two batches of (1, 1, 1, 8): 8 steps each; 4 * 8 - 11 idle slot-steps each
    assert (s.steps, s.useful_slot_steps, s.wasted_slot_steps, s.preemptions) == (16, 22, 42, 0)
    c = continuous_batching_steps(skewed, max_batch=4, num_blocks=64, block_size=4)
    assert (c.steps, c.useful_slot_steps, c.wasted_slot_steps, c.preemptions) == (10, 22, 0, 0)
    assert c.tokens_per_step == (4, 4, 2, 2, 2, 2, 2, 2, 1, 1)  # r3 (8 tokens) runs steps 1-8, r7 steps 3-10


def test_static_matches_the_closed_form():
    reqs = [(5, 3), (2, 9), (7, 1), (1, 4), (3, 6)]
    s = static_batching_steps(reqs, max_batch=2)
    batches = [reqs[0:2], reqs[2:4], reqs[4:5]]
    assert s.steps == sum(max(o for _, o in b) for b in batches) == 9 + 4 + 6
    assert s.wasted_slot_steps == sum(len(b) * max(o for _, o in b) - sum(o for _, o in b) for b in batches)


def test_continuous_preempts_on_a_starved_pool():
    # 4 requests of 4 + 12 tokens = 4 blocks each; a pool of 8 blocks runs 2 at a time after preemptions
    c = continuous_batching_steps([(4, 12)] * 4, max_batch=4, num_blocks=8, block_size=4)
    assert (c.steps, c.useful_slot_steps, c.preemptions) == (20, 48, 2)


def test_batching_bad_input():
    with pytest.raises(ValueError, match=r"requests\[1\] output_len must be an integer >= 1"):
        static_batching_steps([3, 0], max_batch=2)
    with pytest.raises(ValueError, match="cannot hold the longest request"):
        continuous_batching_steps([(8, 9)], max_batch=1, num_blocks=2, block_size=4)


def test_speculative_accept_boundaries():
    g = torch.Generator().manual_seed(0)
    assert speculative_accept([0.0, 1.0], [0.5, 0.5], 1, g) == (True, 1)  # p >= q: always accepted
    assert speculative_accept([0.0, 1.0], [0.5, 0.5], 0, g) == (False, 1)  # p == 0: never; resampled from p - q
    assert speculative_accept([0.2, 0.8], None, 0, g)[1] in (0, 1)  # one-hot q
    assert speculative_accept([1.0, 0.0], None, 1, g) == (False, 0)
    with pytest.raises(ValueError, match="q has 3 entries"):
        speculative_accept([0.5, 0.5], [0.2, 0.3, 0.5], 0)
    with pytest.raises(ValueError, match="p must be finite, >= 0 and sum to 1"):
        speculative_accept([0.5, 0.6], None, 0)
    with pytest.raises(ValueError, match="draft_token must be an integer in \\[0, 1\\]"):
        speculative_accept([0.5, 0.5], None, 2)


def test_speculative_accept_emits_p_chi_square():
    """Seeded trials through the real RejectionSampler: emitted tokens follow p; acceptance = sum min(p, q)."""
    p = torch.tensor([0.05, 0.40, 0.25, 0.10, 0.20])
    q = torch.tensor([0.40, 0.10, 0.10, 0.30, 0.10])
    g = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, 3000, replacement=True, generator=g).tolist()
    outs = [speculative_accept(p, q, d, g) for d in drafts]
    tokens = torch.tensor([t for _, t in outs])
    stat, p_value = chi_square(tokens, p)
    assert p_value > 1e-3, (stat, p_value)
    rate = sum(a for a, _ in outs) / len(outs)
    alpha = float(torch.minimum(p, q).sum())  # 0.55
    assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / len(outs)) ** 0.5
    # and the test has power: the drafts themselves (q) are far from p
    assert chi_square(torch.tensor(drafts), p)[1] < 1e-6


def test_worked_numbers_are_the_docs():
    w = lab.worked_numbers()
    assert w["blocks_needed(8, 4)"] == 2 and w["append 9th token -> new blocks"] == [2]
    assert w["static  [1,1,1,8,1,1,1,8] batch 4"] == {"steps": 16, "useful_slot_steps": 22, "wasted_slot_steps": 42}
    assert w["continuous [1,1,1,8,1,1,1,8] batch 4"] == {"steps": 10, "useful_slot_steps": 22,
                                                         "wasted_slot_steps": 0}
