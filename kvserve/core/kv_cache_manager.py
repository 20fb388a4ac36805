"""Per-request block tables over the shared ``BlockPool``, with automatic prefix caching.

A request holding ``n`` tokens of K/V owns ``blocks_needed(n, block_size)`` blocks; appending token ``n + 1``
takes a new block iff ``n % block_size == 0``. Memory is allocated as tokens arrive, never reserved for
``max_tokens`` up front (the "naive reservation" that ``KVCacheStats`` reports for comparison).

With ``enable_prefix_caching``, ``get_computed_blocks`` finds the longest chain of cached full blocks matching a
request's tokens; admission takes references to them and starts ``num_computed_tokens`` after them. Full blocks
enter the cache once their tokens have been computed (``cache_computed_blocks``, after each step), never
partial blocks.

Sliding window (vLLM's ``SlidingWindowManager``; Mistral 7B v0.1, every layer windowed): with ``sliding_window``
``w``, the token at position ``p`` reads only the keys ``p - w < j <= p``. Before each allocation, the blocks
wholly before the window of the request's next token (position ``num_computed_tokens``) -- the first
``skipped_blocks(num_computed_tokens)`` -- go back to the pool; their table entries become placeholders
(``None`` here, block id ``NULL_BLOCK_ID`` in ``get_block_ids``), which the kernel never reads (it starts at a
row's window) and the reference backend reads only under its mask. ``num_computed_tokens`` never falls below the
count a block was freed at (rejected drafts roll back only tokens scheduled after it; preemption frees everything),
so a freed block is never needed again. Prefix caching: blocks are freed only after they were computed, so they
were entered in the cache first and wait in the free queue with their hashes; a later request's lookup still walks
the chain from the first block (a hit needs every leading block still cached), and the hit's blocks wholly before
its window are not referenced at all (placeholders from the start). vLLM instead looks for the window's worth of
cached blocks ending at the hit and lets earlier ones be evicted; here such a hit is shorter, never wrong. A model
with some full-attention layers keeps every block (the engine passes no window).
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


#: The block id a freed (skipped) table entry shows in ``get_block_ids``: the same as the batch's padding.
NULL_BLOCK_ID = 0


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
        sliding_window: every layer's attention window in tokens (``shared_window``), so blocks before a request's
            window go back to the pool (module docstring); ``None``: keep every block.

    Attributes:
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the cache at admissions.

    Raises:
        ValueError: ``sliding_window`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        # request_id -> its block table; None for an entry freed behind a sliding window
        self.req_to_blocks: dict[str, list[Optional[KVCacheBlock]]] = {}
        # request_id -> the same table as block ids, kept in step with req_to_blocks, so that get_block_ids (once per
        # scheduled request per step) is a list copy instead of a walk over the blocks
        self._block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # request_id -> how many of its leading blocks are in the cache
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src_block_id, dst_block_id) copy-on-write copies for the next step
        #: ``(block_id, BlockHash)`` of each block ``cache_computed_blocks`` entered in the cache, for the disk tier
        #: (``take_newly_cached``); ``None``: not recorded (no tier).
        self.newly_cached: Optional[list[tuple[int, BlockHash]]] = None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @staticmethod
    def shared_window(layer_windows: Iterable[Optional[int]]) -> Optional[int]:
        """The window to free blocks by for a model whose layers have windows ``layer_windows`` (``None``: a full
        attention layer): their common window when every layer has the same one, else ``None`` (keep every block:
        a full layer reads every key; with different windows, the widest would do, but no family has that)."""
        windows = set(layer_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks no layer reads any more once the next token is at position
        ``num_computed_tokens``: those wholly before its window, ``(p - w + 1) // block_size`` (0 without a
        window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _free_skipped(self, rid: str, held: list, n: int) -> None:
        """Return the first ``n`` blocks of table ``held`` (request ``rid``) to the pool, leaving placeholders;
        tail first, like ``free``, so the first block of a cached chain is the last of them evicted. The
        placeholders always form a prefix of the table, so only the entries after it are visited: amortised
        O(blocks newly freed) per call, not O(table) every step."""
        start = n
        while start > 0 and held[start - 1] is not None:
            start -= 1
        if start == n:
            return
        freed = held[start:n][::-1]
        ids = self._block_ids[rid]
        for i in range(start, n):
            held[i] = None
            ids[i] = NULL_BLOCK_ID
        self.block_pool.free_blocks(freed)

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
        if held is not None and self.sliding_window is not None:
            self._free_skipped(rid, held, min(len(held), self.skipped_blocks(computed)))
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
        computed_blocks = list(computed_blocks)
        n_hit = len(computed_blocks)
        total = computed + n_hit * bs + num_new_tokens
        need = -(-total // bs) - len(held) - n_hit  # blocks_needed(total); total >= 0
        # hits wholly before the window of the first token to compute are not referenced (placeholders)
        n_skip = min(n_hit, self.skipped_blocks(computed + n_hit * bs)) if first else 0
        kept = computed_blocks[n_skip:]
        reclaimed = sum(1 for b in kept if b.ref_cnt == 0) if kept else 0  # leave the free queue
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
            pool.touch(kept)
            held.extend([None] * n_skip + kept)
            ids.extend([NULL_BLOCK_ID] * n_skip + [b.block_id for b in kept])
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
        self.block_pool.touch([b for b in blocks if b is not None])
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
        record = self.newly_cached
        for i in range(start, n_full):
            if blocks[i] is not None:  # (a freed block was entered before it was freed)
                if self.block_pool.cache_block(blocks[i], hashes[i]) and record is not None:
                    record.append((blocks[i].block_id, hashes[i]))
        self.num_cached_blocks[rid] = n_full

    def take_newly_cached(self) -> list[tuple[int, BlockHash]]:
        """The ``(block_id, BlockHash)`` of the blocks entered in the cache since the last call (computed here, not
        loaded); empty unless ``newly_cached`` is a list. The blocks' contents are valid until the next
        ``allocate_slots`` (a freed one may be reused then)."""
        if not self.newly_cached:
            return []
        out, self.newly_cached = self.newly_cached, []
        return out

    def reserve_for_load(self, request: SeqLike, hits: list[KVCacheBlock], n: int) -> Optional[list[KVCacheBlock]]:
        """Give ``request`` (not yet holding blocks) a table of its prefix-cache ``hits`` (referenced, so they stay
        while it waits) and ``n`` new blocks to load its next blocks into from the disk tier. The caller copies the
        contents in, enters the new blocks in the cache and frees the table (``free``).

        Returns:
            the ``n`` new blocks, or ``None`` (nothing taken) if the pool cannot supply them.
        """
        pool = self.block_pool
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)
        if n > pool.num_free_blocks - reclaimed:
            return None
        pool.touch(hits)
        new = pool.get_new_blocks(n)
        self.req_to_blocks[request.request_id] = list(hits) + new
        self._block_ids[request.request_id] = [b.block_id for b in hits + new]
        return new

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
        self.block_pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def get_block_ids(self, request: SeqLike) -> list[int]:
        """The request's block table: physical block ids in logical order (``NULL_BLOCK_ID`` for a block freed
        behind its sliding window)."""
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
                if b is None:
                    continue
                n = min(bs, r.num_computed_tokens - i * bs)
                if n > fill.get(b.block_id, 0):
                    fill[b.block_id] = n
        return sum(fill.values())

    def check_integrity(self) -> None:
        """Assert the DESIGN.md invariants: sum(ref_cnt) == block-table entries (placeholders of freed blocks not
        counted); free + used == total."""
        self.block_pool.check_integrity()
        entries = sum(sum(b is not None for b in t) for t in self.req_to_blocks.values())
        assert self._block_ids == {rid: [NULL_BLOCK_ID if b is None else b.block_id for b in t]
                                   for rid, t in self.req_to_blocks.items()}
        assert sum(b.ref_cnt for b in self.block_pool.blocks) == entries
        assert self.block_pool.num_free_blocks + self.block_pool.num_used_blocks == self.num_blocks
