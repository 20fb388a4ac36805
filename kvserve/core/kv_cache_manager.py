"""Per-request block tables over the shared ``BlockPool``, with automatic prefix caching.

A request holding ``n`` tokens of K/V owns ``blocks_needed(n, block_size)`` blocks; appending token ``n + 1``
takes a new block iff ``n % block_size == 0``. Memory is allocated as tokens arrive, never reserved for
``max_tokens`` up front (the "naive reservation" that ``KVCacheStats`` reports for comparison).

With ``enable_prefix_caching``, ``get_computed_blocks`` finds the longest chain of cached full blocks matching a
request's tokens; admission takes references to them and starts ``num_computed_tokens`` after them. Full blocks
enter the cache once their tokens have been computed (``cache_computed_blocks``, after each step), never
partial blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

from kvserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block


class SeqLike(Protocol):
    """What the manager reads of a request (``Request``, or the draft proposer's ``_DraftSeq``).

    ``request_id`` keys its block table; ``num_computed_tokens`` is how many of its tokens have K/V. Prefix caching
    (``block_hashes``, ``get_computed_blocks``, ``cache_computed_blocks``) also reads ``num_tokens``,
    ``all_token_ids`` and the ``block_hashes`` list it extends.
    """

    request_id: str
    num_computed_tokens: int


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
        tokens_stored: tokens whose K/V is in the blocks of running requests (a shared block counted once).
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
        enable_prefix_caching: reuse cached full blocks across requests.

    Attributes:
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the cache at admissions.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> the same table as block ids, kept in step with req_to_blocks, so that get_block_ids (once per
        # scheduled request per step) is a list copy instead of a walk over the blocks
        self._block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # request_id -> how many of its leading blocks are in the cache
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src_block_id, dst_block_id) copy-on-write copies for the next step

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def block_hashes(self, request: SeqLike) -> list[BlockHash]:
        """Chained ``BlockHash`` of each full block of the request's known tokens (extended incrementally and
        kept on ``request.block_hashes``)."""
        hashes = request.block_hashes
        bs = self.block_size
        n_full = request.num_tokens // bs
        if len(hashes) < n_full:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), n_full):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: SeqLike) -> list[KVCacheBlock]:
        """The longest run of cached blocks matching the request's leading full blocks.

        Capped at ``(num_tokens - 1) // block_size`` blocks so at least the last token is computed (its logits
        are needed): a fully cached prompt that is an exact multiple of ``block_size`` recomputes its last block.
        Takes no reference; pass the result to ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self.block_hashes(request)[: (request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: SeqLike, num_new_tokens: int,
                       computed_blocks: Iterable[KVCacheBlock] = ()) -> Optional[list[int]]:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens`` (plus, at admission,
        after the prefix-cache hits ``computed_blocks``, which are referenced on success).

        Returns:
            the ids of the newly taken blocks (possibly ``[]``), or ``None`` if the pool cannot supply them;
            on ``None`` nothing was allocated or referenced.
        """
        rid = request.request_id
        bs = self.block_size
        pool = self.block_pool
        computed = request.num_computed_tokens
        held = self.req_to_blocks.get(rid)
        if held is not None and not computed_blocks:  # a running request's next tokens: the per-step path
            need = -(-(computed + num_new_tokens) // bs) - len(held)  # blocks_needed(total) - held
            i, offset = divmod(computed, bs)
            if not (offset and i < len(held) and held[i].ref_cnt > 1):  # (else: copy-on-write, below)
                if need <= 0:
                    return []
                if need > len(pool._free):
                    return None
                new = pool.get_new_blocks(need)
                held.extend(new)
                new_ids = [b.block_id for b in new]
                self._block_ids[rid].extend(new_ids)
                return new_ids
        first = held is None  # (a static batch member is allocated before its first chunk runs)
        if first:
            held = []
        n_hit = len(computed_blocks)
        total = computed + n_hit * bs + num_new_tokens
        need = -(-total // bs) - len(held) - n_hit  # blocks_needed(total); total >= 0
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0) if n_hit else 0  # leave the free queue
        # the partially filled block the next token goes into, if other tables share it (copy-on-write)
        i, offset = divmod(computed, bs)
        cow = i if offset and i < len(held) and held[i].ref_cnt > 1 else None
        if (need if need > 0 else 0) + (cow is not None) > len(pool._free) - reclaimed:
            return None
        if cow is not None:
            self._copy_on_write(rid, held, cow)
        if first:
            self.req_to_blocks[rid] = held
            self._block_ids[rid] = []
        ids = self._block_ids[rid]
        if computed_blocks:
            pool.touch(computed_blocks)
            held.extend(computed_blocks)
            ids.extend([b.block_id for b in computed_blocks])
            self.num_cached_blocks[rid] = n_hit
        if first and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += n_hit * bs
        if need <= 0:
            return []
        new = pool.get_new_blocks(need)
        held.extend(new)
        new_ids = [b.block_id for b in new]
        ids.extend(new_ids)
        return new_ids

    def _copy_on_write(self, rid: str, held: list[KVCacheBlock], i: int) -> None:
        """Give the table ``held`` of request ``rid`` a private copy of its shared block ``i`` (the copy itself is
        queued in ``pending_copies`` and done by the model runner before the step's writes)."""
        shared = held[i]
        [private] = self.block_pool.get_new_blocks(1)
        self.pending_copies.append((shared.block_id, private.block_id))
        held[i] = private
        self._block_ids[rid][i] = private.block_id
        self.block_pool.free_blocks([shared])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src, dst)`` block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """Give ``child`` the same block table as ``parent`` (every block gains a reference): the ``n`` samples of
        one prompt share its blocks; a later write into a shared partial block is copied first (copy-on-write)."""
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self._block_ids[child.request_id] = list(self._block_ids[parent.request_id])
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def cache_computed_blocks(self, request: SeqLike) -> None:
        """Enter the request's full blocks whose tokens are all computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        n_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if n_full <= start:
            return
        blocks, hashes = self.req_to_blocks[rid], self.block_hashes(request)
        for i in range(start, n_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = n_full

    def trim(self, request: SeqLike) -> None:
        """Release the tail blocks that hold no computed token of ``request`` (after rejected draft tokens)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        keep = blocks_needed(request.num_computed_tokens, self.block_size)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            del self._block_ids[request.request_id][keep:]
            self.block_pool.free_blocks(reversed(extra))

    def free(self, request: SeqLike) -> None:
        """Release every block of ``request`` (tail first); cached blocks keep their contents until evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: SeqLike) -> list[int]:
        """The request's block table: physical block ids in logical order."""
        return list(self._block_ids.get(request.request_id, ()))

    def stats(self, running: Iterable = ()) -> KVCacheStats:
        """Snapshot of the pool; ``running`` (requests with blocks) gives stored tokens and the naive reservation."""
        used = self.block_pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=used,
            free_blocks=self.block_pool.num_free_blocks,
            tokens_stored=self._stored_tokens(running),
            tokens_allocated=used * self.block_size,
            naive_reserved_tokens=sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in running),
        )

    def _stored_tokens(self, running) -> int:
        """Tokens with K/V in the blocks the ``running`` requests hold, each shared block counted once."""
        fill: dict = {}
        bs = self.block_size
        for r in running:
            for i, b in enumerate(self.req_to_blocks.get(r.request_id, ())):
                n = min(bs, r.num_computed_tokens - i * bs)
                if n > fill.get(b.block_id, 0):
                    fill[b.block_id] = n
        return sum(fill.values())

    def check_integrity(self) -> None:
        """Assert the DESIGN.md invariants: sum(ref_cnt) == block-table entries; free + used == total."""
        self.block_pool.check_integrity()
        entries = sum(len(b) for b in self.req_to_blocks.values())
        assert self._block_ids == {rid: [b.block_id for b in t] for rid, t in self.req_to_blocks.items()}
        assert sum(b.ref_cnt for b in self.block_pool.blocks) == entries
        assert self.block_pool.num_free_blocks + self.block_pool.num_used_blocks == self.num_blocks
