"""``examples/lab.py``: the textbook mechanisms of LLM serving as small functions, each one a thin layer over the real
engine code (never a second implementation of it).

| function | what it answers | real component underneath |
|---|---|---|
| ``blocks_needed`` | blocks for n tokens | ``kvserve.core.kv_cache_manager.blocks_needed`` (re-exported) |
| ``kv_cache_blocks_fragmentation`` | paged vs naive KV waste of a batch | ``blocks_needed`` |
| ``BlockManager`` | allocate / append / free a sequence's blocks | ``KVCacheManager`` over a ``BlockPool`` |
| ``static_batching_steps`` | steps and wasted slot-steps of static batches | ``Scheduler(scheduling="static")`` |
| ``continuous_batching_steps`` | the same under iteration-level batching | ``Scheduler(scheduling="continuous")`` |
| ``speculative_accept`` | accept or replace one draft token | ``RejectionSampler`` |

The batching functions drive the real ``Scheduler`` and ``KVCacheManager`` with a model-free runner (every request
samples a fixed token and ignores EOS, so it generates exactly its output length), the way
the simulator and ``tests/core/conftest.py`` do (``kvserve.core.fake_runner``). ``python examples/lab.py`` prints the worked numbers of ``docs/lab.md``.

Sources: Kwon et al., SOSP 2023 (PagedAttention: blocks, fragmentation); Yu et al., OSDI 2022 (Orca:
iteration-level scheduling); Leviathan, Kalman, Matias, ICML 2023, Alg. 1 (speculative sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_needed
from kvserve.core.fake_runner import fake_run
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sample.rejection_sampler import RejectionSampler
from kvserve.sampling_params import SamplingParams
from kvserve.validation import check_int

__all__ = [
    "blocks_needed", "Fragmentation", "kv_cache_blocks_fragmentation", "BlockManager", "BatchingResult",
    "static_batching_steps", "continuous_batching_steps", "speculative_accept",
]

#: The token every lab request "samples" (any id works: requests ignore EOS and stop at their output length).
LAB_TOKEN_ID = 7


# ------------------------------------------------------------------------------------------------ fragmentation
@dataclass(frozen=True)
class Fragmentation:
    """KV memory of a batch of sequences, paged vs reserved up front (all counts in tokens).

    Attributes:
        used: tokens stored, ``sum(seq_lens)``.
        paged_slots: slots of the blocks the sequences own, ``sum(blocks_needed(len) * block_size)``.
        paged_waste: ``paged_slots - used``; at most ``block_size - 1`` per sequence (only its last block is
            partly empty).
        naive_slots: ``max_len * len(seq_lens)``: every sequence reserved for the longest it may grow.
        naive_waste: ``naive_slots - used``.
    """

    used: int
    paged_slots: int
    paged_waste: int
    naive_slots: int
    naive_waste: int

    @property
    def paged_waste_fraction(self) -> float:
        """``paged_waste / paged_slots`` (0 when nothing is allocated)."""
        return self.paged_waste / self.paged_slots if self.paged_slots else 0.0

    @property
    def naive_waste_fraction(self) -> float:
        """``naive_waste / naive_slots`` (0 when nothing is reserved)."""
        return self.naive_waste / self.naive_slots if self.naive_slots else 0.0


def kv_cache_blocks_fragmentation(seq_lens: Sequence[int], max_len: int, block_size: int) -> Fragmentation:
    """Paged waste (rounded-up block slots - used) and naive waste (``max_len`` per sequence - used), in tokens.

    Args:
        seq_lens: each sequence's current length (prompt + output so far), tokens, ``0 <= len <= max_len``.
        max_len: the length a naive allocator reserves per sequence (e.g. prompt + ``max_tokens``), ``>= 1``.
        block_size: tokens per KV block, ``>= 1``.

    Returns:
        a ``Fragmentation`` (tokens, plus the two waste fractions as properties).

    Raises:
        ValueError: ``max_len`` or ``block_size`` below 1, or a length outside ``[0, max_len]`` (naming its index).
    """
    check_int("max_len", max_len, 1)
    check_int("block_size", block_size, 1)
    for i, n in enumerate(seq_lens):
        check_int(f"seq_lens[{i}]", n, 0, max_len)
    used = sum(seq_lens)
    paged = sum(blocks_needed(n, block_size) * block_size for n in seq_lens)
    naive = max_len * len(seq_lens)
    return Fragmentation(used, paged, paged - used, naive, naive - used)


# ------------------------------------------------------------------------------------------------ block manager
class _Seq:
    """What ``KVCacheManager`` reads of a sequence (``SeqLike``): its id and how many tokens have K/V."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.num_computed_tokens = 0


class BlockManager:
    """The seeds' block manager as a facade over the real ``KVCacheManager`` (prefix caching off).

    Each sequence owns a block table; a sequence of ``n`` tokens holds ``blocks_needed(n, block_size)`` blocks, and
    appending token ``n + 1`` takes a new block iff ``n % block_size == 0``.

    Args:
        num_blocks: blocks in the pool, ``>= 1``.
        block_size: tokens per block, ``>= 1``.

    Attributes:
        kv_cache_manager: the real manager underneath (its ``block_pool`` holds the ref counts and free queue).
    """

    def __init__(self, num_blocks: int, block_size: int):
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._seqs: dict[str, _Seq] = {}

    @property
    def block_size(self) -> int:
        return self.kv_cache_manager.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_free_blocks

    def _get(self, seq_id) -> _Seq:
        seq = self._seqs.get(str(seq_id))
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r} is not allocated")
        return seq

    def allocate(self, seq_id, num_tokens: int) -> Optional[list[int]]:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens.

        Returns:
            its block ids (``blocks_needed(num_tokens, block_size)`` of them), or ``None`` when the pool has too
            few free blocks; then nothing is allocated (no half-allocated sequence).

        Raises:
            ValueError: ``seq_id`` already allocated, or ``num_tokens < 0``.
        """
        check_int("num_tokens", num_tokens, 0)
        if str(seq_id) in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        seq = _Seq(str(seq_id))
        if self.kv_cache_manager.allocate_slots(seq, num_tokens) is None:
            return None
        seq.num_computed_tokens = num_tokens
        self._seqs[seq.request_id] = seq
        return self.kv_cache_manager.get_block_ids(seq)

    def append(self, seq_id) -> Optional[list[int]]:
        """Add one token to the sequence.

        Returns:
            the ids of the blocks this took: ``[new_id]`` when the length was an exact multiple of ``block_size``,
            else ``[]``; ``None`` when a block was needed and none is free (the sequence is unchanged).

        Raises:
            ValueError: unknown ``seq_id``.
        """
        seq = self._get(seq_id)
        new = self.kv_cache_manager.allocate_slots(seq, 1)
        if new is not None:
            seq.num_computed_tokens += 1
        return new

    def free(self, seq_id) -> None:
        """Return all the sequence's blocks to the pool.

        Raises:
            ValueError: unknown ``seq_id``.
        """
        seq = self._get(seq_id)
        self.kv_cache_manager.free(seq)
        del self._seqs[seq.request_id]

    def block_table(self, seq_id) -> list[int]:
        """The sequence's block ids in logical order (token ``i`` lives in ``table[i // block_size]``).

        Raises:
            ValueError: unknown ``seq_id``.
        """
        return self.kv_cache_manager.get_block_ids(self._get(seq_id))

    def num_tokens(self, seq_id) -> int:
        """The sequence's length in tokens."""
        return self._get(seq_id).num_computed_tokens


# ------------------------------------------------------------------------------------------------ batching
@dataclass(frozen=True)
class BatchingResult:
    """How a batch of requests ran on the real scheduler.

    Attributes:
        steps: scheduler steps until every request finished.
        useful_slot_steps: slot-steps that produced a token (= total output tokens).
        wasted_slot_steps: slot-steps held but idle: in a static batch, the slots of requests that already
            finished while the batch drains to its longest request; in continuous batching, slots of running
            requests that got no token that step (prefill chunks that do not reach the end). A slot freed and
            refilled in the same step (continuous) is never idle.
        preemptions: preemptions by recompute (continuous, when the pool runs out of blocks).
        tokens_per_step: output tokens per step, one entry per step.
    """

    steps: int
    useful_slot_steps: int
    wasted_slot_steps: int
    preemptions: int
    tokens_per_step: tuple


RequestSpec = Union[int, tuple]


def _lab_requests(requests: Sequence[RequestSpec]) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` pairs from ints (output lengths; 1-token prompts) or pairs.

    Raises:
        ValueError: a request that is neither, or a length below 1 (naming its index).
    """
    out = []
    for i, r in enumerate(requests):
        if isinstance(r, (tuple, list)) and len(r) == 2:
            prompt_len, output_len = r
        elif isinstance(r, int) and not isinstance(r, bool):
            prompt_len, output_len = 1, r
        else:
            raise ValueError(f"requests[{i}] must be an output length (int) or (prompt_len, output_len), got {r!r}")
        check_int(f"requests[{i}] prompt_len", prompt_len, 1)
        check_int(f"requests[{i}] output_len", output_len, 1)
        out.append((prompt_len, output_len))
    if not out:
        raise ValueError("requests must not be empty")
    return out


def _run_batching(requests, scheduling: str, max_batch: int, num_blocks: int, block_size: int) -> BatchingResult:
    reqs = _lab_requests(requests)
    check_int("max_batch", max_batch, 1)
    check_int("num_blocks", num_blocks, 1)
    check_int("block_size", block_size, 1)
    longest = max(p + o for p, o in reqs)
    if blocks_needed(longest, block_size) > num_blocks:
        raise ValueError(f"num_blocks={num_blocks} cannot hold the longest request ({longest} tokens, "
                         f"{blocks_needed(longest, block_size)} blocks of {block_size})")
    budget = max(sum(p for p, _ in reqs), max_batch)  # every prompt fits one step: steps count decode iterations
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=budget, scheduling=scheduling),
                      kv, eos_token_ids=())
    for i, (p, o) in enumerate(reqs):
        sp = SamplingParams(max_tokens=o, ignore_eos=True, temperature=0)
        sched.add_request(Request(str(i), [LAB_TOKEN_ID] * p, sp, max_total_tokens=p + o))
    steps = useful = wasted = 0
    batch_slots = 0
    per_step = []
    while sched.has_unfinished_requests():
        if scheduling == "static" and not sched.running:
            batch_slots = 0
        so = sched.schedule()
        if scheduling == "static":
            batch_slots = max(batch_slots, len(sched.running))  # the batch claims its slots until it drains
            held = batch_slots
        else:
            held = len(so.scheduled)
        out = fake_run(so, LAB_TOKEN_ID)
        sched.update_from_output(so, out)
        tokens = sum(len(t) for t in out.sampled_token_ids.values())
        steps += 1
        useful += tokens
        wasted += held - len(out.sampled_token_ids)
        per_step.append(tokens)
        if steps > 10 * sum(p + o for p, o in reqs) + 100:  # cannot happen with a valid pool: a guard, not a limit
            raise RuntimeError("scheduler did not drain")
    return BatchingResult(steps, useful, wasted, sched.num_preemptions, tuple(per_step))


def static_batching_steps(requests: Sequence[RequestSpec], max_batch: int, num_blocks: Optional[int] = None,
                          block_size: int = 16) -> BatchingResult:
    """Run ``requests`` in static batches of up to ``max_batch`` (FCFS) on the real scheduler.

    A batch is admitted only when the previous one has drained, and runs until its longest request finishes, so
    ``steps == sum over batches of max(output_len)`` and ``wasted_slot_steps == sum over batches of
    (batch size * max(output_len) - sum(output_len))``.

    Args:
        requests: output lengths (ints, with 1-token prompts) or ``(prompt_len, output_len)`` pairs, tokens.
        max_batch: ``max_num_seqs``.
        num_blocks: KV pool size; default: enough for every request at once (memory is not the limit).
        block_size: tokens per block.

    Returns:
        a ``BatchingResult``.

    Raises:
        ValueError: bad requests or limits, or a pool that cannot hold the longest request.
    """
    reqs = _lab_requests(requests)
    if num_blocks is None:
        num_blocks = sum(blocks_needed(p + o, block_size) for p, o in reqs)
    return _run_batching(reqs, "static", max_batch, num_blocks, block_size)


def continuous_batching_steps(requests: Sequence[RequestSpec], max_batch: int, num_blocks: int,
                              block_size: int) -> BatchingResult:
    """Run ``requests`` with iteration-level (continuous) batching on the real scheduler and KV cache manager.

    A finished request's slot and blocks are reused in the very next step. When the pool runs out of blocks the
    newest running request is preempted (recomputed later), which costs steps but never wrong output.

    Args:
        requests: output lengths (ints, with 1-token prompts) or ``(prompt_len, output_len)`` pairs, tokens.
        max_batch: ``max_num_seqs``.
        num_blocks: KV pool size, blocks (must hold the longest request).
        block_size: tokens per block.

    Returns:
        a ``BatchingResult``.

    Raises:
        ValueError: bad requests or limits, or a pool that cannot hold the longest request.
    """
    return _run_batching(requests, "continuous", max_batch, num_blocks, block_size)


# ------------------------------------------------------------------------------------------------ speculation
def _as_dist(name: str, x, size: Optional[int] = None) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D distribution, got shape {tuple(t.shape)}")
    if size is not None and t.numel() != size:
        raise ValueError(f"{name} has {t.numel()} entries, p has {size}; both must cover the same vocabulary")
    if bool((t < 0).any()) or not bool(torch.isfinite(t).all()) or abs(float(t.sum()) - 1.0) > 1e-4:
        raise ValueError(f"{name} must be finite, >= 0 and sum to 1 (sums to {float(t.sum()):.6g})")
    return t.float()


def speculative_accept(p, q, draft_token: int, generator: Optional[torch.Generator] = None) -> tuple[bool, int]:
    """Verify one draft token (Leviathan et al. 2023, Alg. 1) through the real ``RejectionSampler``.

    The draft is accepted with probability ``min(1, p[t] / q[t])``; otherwise a token is drawn from
    ``normalize(max(0, p - q))``. Either way the token returned is distributed exactly as ``p``.

    Args:
        p: ``[V]`` target distribution (list or tensor, sums to 1).
        q: ``[V]`` draft distribution the draft was sampled from, or ``None`` for a deterministic draft
            (``q`` one-hot on ``draft_token``).
        draft_token: the drafted token id, ``0 <= draft_token < V``.
        generator: a ``torch.Generator`` for reproducible draws (one uniform, then ``V`` exponentials per call);
            ``None``: a generator seeded with 0 for this call.

    Returns:
        ``(accepted, token)``: ``(True, draft_token)``, or ``(False, recovered token)``.

    Raises:
        ValueError: a malformed distribution (naming ``p`` or ``q``) or ``draft_token`` out of range.
    """
    pt = _as_dist("p", p)
    v = pt.numel()
    qt = None if q is None else _as_dist("q", q, v)
    check_int("draft_token", draft_token, 0, v - 1)
    target = torch.stack([pt, pt])[None]  # [1, k + 1 = 2, V]: row 1 (the bonus position) is unused here
    out = RejectionSampler(generator)(
        torch.tensor([[draft_token]]), [1], None if qt is None else qt[None, None], target, [False],
        [generator] if generator is not None else [None])
    accepted = int(out[0, 1]) != -1  # an accepted draft is followed by the (unused) bonus token
    return (True, draft_token) if accepted else (False, int(out[0, 0]))


# ------------------------------------------------------------------------------------------------ worked numbers
def worked_numbers() -> dict:
    """The numbers of ``docs/lab.md``, computed on the real components (deterministic)."""
    bm = BlockManager(num_blocks=4, block_size=4)
    first = bm.allocate("a", 8)
    ninth = bm.append("a")
    tenth = bm.append("a")
    frag = kv_cache_blocks_fragmentation([5, 17, 33, 64], max_len=128, block_size=16)
    skewed = [1, 1, 1, 8, 1, 1, 1, 8]
    static = static_batching_steps(skewed, max_batch=4)
    cont = continuous_batching_steps(skewed, max_batch=4, num_blocks=64, block_size=4)
    starved = continuous_batching_steps([(4, 12)] * 4, max_batch=4, num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(0)
    p, q = [0.1, 0.6, 0.3], [0.5, 0.25, 0.25]
    trials = 4000
    tokens = [speculative_accept(p, q, int(torch.multinomial(torch.tensor(q), 1, generator=g)), g) for _ in
              range(trials)]
    return {
        "blocks_needed(8, 4)": blocks_needed(8, 4),
        "blocks_needed(9, 4)": blocks_needed(9, 4),
        "allocate('a', 8) -> blocks": first,
        "append 9th token -> new blocks": ninth,
        "append 10th token -> new blocks": tenth,
        "block_table('a')": bm.block_table("a"),
        "fragmentation [5,17,33,64], max_len 128, block 16": {
            "used": frag.used, "paged_slots": frag.paged_slots, "paged_waste": frag.paged_waste,
            "paged_waste_fraction": round(frag.paged_waste_fraction, 4), "naive_slots": frag.naive_slots,
            "naive_waste": frag.naive_waste, "naive_waste_fraction": round(frag.naive_waste_fraction, 4)},
        "static  [1,1,1,8,1,1,1,8] batch 4": {"steps": static.steps, "useful_slot_steps": static.useful_slot_steps,
                                              "wasted_slot_steps": static.wasted_slot_steps},
        "continuous [1,1,1,8,1,1,1,8] batch 4": {"steps": cont.steps, "useful_slot_steps": cont.useful_slot_steps,
                                                 "wasted_slot_steps": cont.wasted_slot_steps},
        "continuous 4 x (4 in, 12 out), 8 blocks of 4": {"steps": starved.steps,
                                                         "useful_slot_steps": starved.useful_slot_steps,
                                                         "preemptions": starved.preemptions},
        "speculative_accept p=[.1,.6,.3] q=[.5,.25,.25]: acceptance (expected sum min(p,q) = 0.6)":
            round(sum(a for a, _ in tokens) / trials, 3),
        "  emitted token frequencies (expected p)":
            [round(sum(t == i for _, t in tokens) / trials, 3) for i in range(3)],
    }


def main() -> int:
    for k, v in worked_numbers().items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
