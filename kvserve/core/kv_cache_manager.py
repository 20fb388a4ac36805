"""Per-request block tables over the shared ``BlockPool``.

A request holding ``n`` tokens of K/V owns ``blocks_needed(n, block_size)`` blocks; appending token ``n + 1``
takes a new block iff ``n % block_size == 0``. Memory is allocated as tokens arrive, never reserved for
``max_tokens`` up front (the "naive reservation" that ``KVCacheStats`` reports for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvserve.core.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    Raises:
        ValueError: ``num_tokens < 0`` or ``block_size < 1``.
    """
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"need num_tokens >= 0 and block_size >= 1, got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the pool.

    Attributes (blocks or tokens, as named):
        num_blocks, used_blocks, free_blocks: pool occupancy in blocks.
        tokens_stored: tokens whose K/V is in the cache (sum of ``num_computed_tokens`` over block holders).
        tokens_allocated: slots owned by requests, ``used_blocks * block_size``.
        naive_reserved_tokens: what reserving ``prompt + max_tokens`` per running request would take.
    """

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    tokens_stored: int
    tokens_allocated: int
    naive_reserved_tokens: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.used_blocks / self.num_blocks

    @property
    def waste(self) -> float:
        """Allocated but unused slots over allocated slots, 0..1 (0 when nothing is allocated)."""
        return (self.tokens_allocated - self.tokens_stored) / self.tokens_allocated if self.tokens_allocated else 0.0


class KVCacheManager:
    """Maps each request to its list of blocks (its block table) and allocates slots step by step.

    Args:
        num_blocks: size of the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def allocate_slots(self, request, num_new_tokens: int) -> Optional[list]:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        Returns:
            the ids of the newly taken blocks (possibly ``[]``), or ``None`` if the pool cannot supply them;
            on ``None`` nothing was allocated.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if need <= 0:
            return []
        if need > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        new = self.block_pool.get_new_blocks(need)
        blocks.extend(new)
        return [b.block_id for b in new]

    def free(self, request) -> None:
        """Release every block of ``request`` (tail first); a no-op if it holds none."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request) -> list:
        """The request's block table: physical block ids in logical order."""
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def stats(self, running=()) -> KVCacheStats:
        """Snapshot of the pool; ``running`` (requests with blocks) gives stored tokens and the naive reservation."""
        used = self.block_pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=used,
            free_blocks=self.block_pool.num_free_blocks,
            tokens_stored=sum(r.num_computed_tokens for r in running),
            tokens_allocated=used * self.block_size,
            naive_reserved_tokens=sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in running),
        )

    def check_integrity(self) -> None:
        """Assert the DESIGN.md invariants: sum(ref_cnt) == block-table entries; free + used == total."""
        self.block_pool.check_integrity()
        entries = sum(len(b) for b in self.req_to_blocks.values())
        assert sum(b.ref_cnt for b in self.block_pool.blocks) == entries
        assert self.block_pool.num_free_blocks + self.block_pool.num_used_blocks == self.num_blocks
