"""The global pool of KV blocks (PagedAttention, Kwon et al., SOSP 2023, §4.2).

Every physical block has a reference count; a block with ``ref_cnt == 0`` sits in the free queue. Blocks are
taken from the front of the queue and returned to the back, so the queue is also the least-recently-used order
(prefix caching will evict cached blocks in exactly that order).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's cache.

    Attributes:
        block_id: index into the cache's block dimension, ``0 <= block_id < num_blocks``.
        ref_cnt: how many block tables hold this block.
    """

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Fixed set of ``num_blocks`` blocks with reference counts and an ordered free queue.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order: the front is reused first.
        self._free: OrderedDict = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_new_blocks(self, n: int) -> list:
        """Take ``n`` free blocks (``ref_cnt`` becomes 1).

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check ``num_free_blocks`` first).
        """
        if n > len(self._free):
            raise ValueError(f"requested {n} blocks but only {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the free queue, in order.

        Callers pass a request's blocks tail-first so its last blocks are reused first (its prefix lives longest).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def check_integrity(self) -> None:
        """Assert: a block is free iff its ``ref_cnt`` is 0, and no ref count is negative."""
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in self._free), f"block {b.block_id} free-queue mismatch"
