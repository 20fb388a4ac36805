"""The global pool of KV blocks (PagedAttention, Kwon et al., SOSP 2023, §4.2) with automatic prefix caching.

Every physical block has a reference count; a block with ``ref_cnt == 0`` sits in the free queue. Blocks are
taken from the front of the queue and returned to the back, so the queue is also the least-recently-used order.

Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention, Zheng et al. 2024, shares the idea): a
*full* block that has been computed gets a ``BlockHash`` chained on its parent block's hash, its token ids and
extra keys, and is entered in a hash -> block map. When its last holder frees it, it keeps its contents and its
hash while it waits in the free queue; it is evicted lazily, only when ``get_new_blocks`` reuses it, and its map
entry is removed at that moment. A hit on a free cached block takes it back out of the queue (``touch``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BlockHash:
    """Identity of a full block's contents.

    Attributes:
        value: sha256 over (parent value, token ids, extra keys): 32 bytes, the map key.
        parent: the parent block's ``value`` (``b""`` for the first block).
        token_ids: the block's ``block_size`` token ids, kept so that a hash collision is detected (a lookup
            compares them and the parent, so a chain of hits verifies the whole prefix token by token).
    """

    value: bytes
    parent: bytes
    token_ids: tuple


def hash_block(parent: Optional[BlockHash], token_ids, extra_keys: tuple = ()) -> BlockHash:
    """The chained hash of one full block (``token_ids``: ``block_size`` ints)."""
    parent_value = parent.value if parent is not None else b""
    h = hashlib.sha256(parent_value)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest(), parent_value, tuple(token_ids))


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's cache.

    Attributes:
        block_id: index into the cache's block dimension, ``0 <= block_id < num_blocks``.
        ref_cnt: how many block tables hold this block.
        block_hash: set while the block is in the prefix cache (full and computed), else ``None``.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None


class BlockPool:
    """Fixed set of ``num_blocks`` blocks with reference counts, an LRU free queue and a hash -> block map.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order: the front is reused (and, if cached, evicted) first.
        self._free: OrderedDict = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict = {}  # BlockHash.value -> KVCacheBlock
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached ones included: they can be reused at any time)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_new_blocks(self, n: int) -> list:
        """Take ``n`` blocks from the front of the free queue (``ref_cnt`` becomes 1), evicting cached ones.

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check ``num_free_blocks`` first).
        """
        if n > len(self._free):
            raise ValueError(f"requested {n} blocks but only {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached.get(block.block_hash.value) is block:
            del self.cached[block.block_hash.value]
        block.block_hash = None
        self.num_evictions += 1

    def lookup(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The cached block with exactly this content (hash, parent and token ids all equal), else ``None``."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks) -> None:
        """Take a reference to each (cached) block, removing free ones from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Enter a full, computed block in the prefix cache; ``False`` (and nothing done) if it or an equal block
        is cached already."""
        if block.block_hash is not None or block_hash.value in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash.value] = block
        return True

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the free queue, in order.

        Callers pass a request's blocks tail-first, so its last blocks are evicted first and its prefix, the
        part other requests are likeliest to share, lives longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents; nothing is freed)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    def check_integrity(self) -> None:
        """Assert: a block is free iff its ``ref_cnt`` is 0; ref counts are >= 0; the hash map and the blocks'
        hashes agree."""
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in self._free), f"block {b.block_id} free-queue mismatch"
        for value, b in self.cached.items():
            assert b.block_hash is not None and b.block_hash.value == value, f"block {b.block_id} hash mismatch"
