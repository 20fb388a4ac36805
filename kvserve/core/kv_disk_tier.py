"""The prefix cache's disk tier off the step thread: a few threads read and write ``DiskBlockStore`` entries.

The scheduler asks ``num_present`` (one ``stat`` per block, on the step thread) how many of a request's next
blocks the store holds, and ``load`` reads them in the worker threads (``LoadResult``: the payloads of the leading
blocks that were whole and verified). The engine hands each block that became full and cached to ``save`` with a
copy of its bytes (taken on the step thread, so the block may be reused at once); a worker writes it. Writes wait
in a queue bounded by ``max_pending_bytes``: beyond it a block is not written (counted in
``KVTierStats.writes_dropped``), so a slow disk never grows memory without bound.

Why blocks are written when they become cached, not when the pool evicts them: at eviction the block's memory is
handed to another request in the same call, so its bytes would have to be copied on the step thread at the worst
moment; blocks still in the pool at a crash or a restart would be lost; and the other processes of a data-parallel
deployment see a block as soon as one of them has computed it. The cost is writing blocks that the pool alone
would have served; each key is written once per directory (``put`` skips existing files).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from kvserve.core.block_pool import BlockHash
from kvserve.core.kv_disk_store import DiskBlockStore

logger = logging.getLogger(__name__)

#: Worker threads of a tier (reads and writes share them).
DEFAULT_NUM_THREADS = 2
#: Niceness added to the worker threads (Linux: per thread), so that on a machine whose cores the step's threads
#: fill, reads and writes take the idle moments instead of stretching a parallel region of the step.
WORKER_NICENESS = 5
#: A load is split over the threads in parts of at least this many blocks.
MIN_BLOCKS_PER_PART = 8
#: Bytes of block copies waiting to be written, at most.
DEFAULT_MAX_PENDING_BYTES = 256 * 1024**2


def _lower_priority() -> None:
    """Make the calling (worker) thread ``WORKER_NICENESS`` nicer (a no-op where threads have no priority of
    their own)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
    except (AttributeError, OSError):
        pass


@dataclass
class KVTierStats:
    """Counters of one engine's disk tier since start.

    Attributes:
        lookups: blocks looked up in the store (those after a request's pool hits, up to the last prompt token).
        hits: blocks loaded from the store and entered in the pool; ``misses = lookups - hits``.
        bad_entries: entries found torn, truncated, foreign or corrupted (deleted and recomputed).
        bytes_read, bytes_written: payload + entry bytes moved.
        blocks_written: entries written by this process.
        writes_dropped: blocks not written because the write queue was full or writes are off.
        loads, load_seconds: load jobs finished and their total time from start to the copy (seconds).
        load_seconds_samples: the most recent jobs' times (seconds), for histograms.
    """

    lookups: int = 0
    hits: int = 0
    bad_entries: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    load_seconds_samples: list = field(default_factory=list)

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        """Blocks loaded over blocks looked up, 0..1 (0 with none)."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class LoadResult:
    """What a load job read: ``payloads[i]`` is block ``i``'s (only the leading run of whole, verified entries);
    ``seconds`` how long the reads took."""

    payloads: list
    seconds: float


class KVDiskTier:
    """Asynchronous reads and writes of one ``DiskBlockStore``.

    Args:
        store: the entries.
        payload_bytes: bytes of one block's payload (the model runner's ``block_nbytes``).
        num_threads: worker threads.
        max_pending_bytes: bound on the bytes of block copies queued for writing.
    """

    def __init__(self, store: DiskBlockStore, payload_bytes: int, num_threads: int = DEFAULT_NUM_THREADS,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self.store = store
        self.payload_bytes = payload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.num_threads = num_threads
        self.stats = KVTierStats()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kvserve-kv-disk", initializer=_lower_priority)
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._writes: set[Future] = set()
        self._queued: set[bytes] = set()  # keys of the writes waiting in the queue

    # ------------------------------------------------------------------------------------------------ reads
    def num_present(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes`` (a request's next blocks, in order) have an entry, counting from the first (the
        caller counts its lookups in ``stats.lookups``)."""
        n = 0
        for h in hashes:
            if not self.store.contains(h):
                break
            n += 1
        return n

    def load(self, hashes: Sequence[BlockHash]) -> "Future[LoadResult]":
        """Read the entries of ``hashes`` in the worker threads (split in contiguous parts of at least
        ``MIN_BLOCKS_PER_PART``, one per thread: reads and checksums release the GIL); the future's ``LoadResult``
        holds the payloads of the leading run of good entries (each part stops at its first missing or bad one,
        and the parts after a short one are not used)."""
        hashes = list(hashes)
        k = max(1, min(self.num_threads, len(hashes) // MIN_BLOCKS_PER_PART))
        size = -(-len(hashes) // k)
        parts = [self._pool.submit(self._read, hashes[i : i + size]) for i in range(0, len(hashes), size)]
        if len(parts) == 1:
            return parts[0]
        combined: Future = Future()
        left = [len(parts)]
        lock = threading.Lock()

        def part_done(_) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            payloads, seconds = [], 0.0
            for i, part in enumerate(parts):
                r = part.result()
                payloads += r.payloads
                seconds = max(seconds, r.seconds)
                if len(r.payloads) < len(hashes[i * size : (i + 1) * size]):
                    break
            combined.set_result(LoadResult(payloads, seconds))

        for part in parts:
            part.add_done_callback(part_done)
        return combined

    def _read(self, hashes: list[BlockHash]) -> LoadResult:
        start = time.monotonic()
        out = []
        for h in hashes:
            payload = self.store.get(h, self.payload_bytes)
            if payload is None:
                break
            out.append(payload)
        return LoadResult(out, time.monotonic() - start)

    def finish_load(self, result: LoadResult, seconds: float) -> None:
        """Account a finished load whose blocks entered the pool (``seconds``: from its start to now)."""
        n = len(result.payloads)
        s = self.stats
        s.hits += n
        s.bad_entries = self.store.num_bad_entries
        s.bytes_read += n * self.payload_bytes
        s.loads += 1
        s.load_seconds += seconds
        s.load_seconds_samples.append(seconds)
        del s.load_seconds_samples[:-256]

    # ------------------------------------------------------------------------------------------------ writes
    def wants(self, block_hash: BlockHash) -> bool:
        """Whether ``save`` would write this block: writes are on, it is neither queued nor in the store (an entry
        evicted from the store is written again), and the write queue has room. Cheap (a set lookup and a
        ``stat``); call it before copying the block out."""
        if not self.store.write_enabled:
            self.stats.writes_dropped += 1
            return False
        if block_hash.value in self._queued or self.store.contains(block_hash):
            return False
        if self._pending_bytes + self.payload_bytes > self.max_pending_bytes:
            self.stats.writes_dropped += 1
            return False
        return True

    def save(self, block_hash: BlockHash, payload: Sequence) -> None:
        """Write the entry of ``block_hash`` (``payload``: bytes-like chunks that no one else writes to) in a worker
        thread."""
        size = sum(memoryview(c).nbytes for c in payload)
        with self._lock:
            self._pending_bytes += size
            self._queued.add(block_hash.value)
        fut = self._pool.submit(self._write, block_hash, payload, size)
        with self._lock:
            self._writes.add(fut)
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut: Future) -> None:
        with self._lock:
            self._writes.discard(fut)

    def _write(self, block_hash: BlockHash, payload: Sequence, size: int) -> None:
        try:
            written = self.store.put(block_hash, payload)
        finally:
            with self._lock:
                self._pending_bytes -= size
                self._queued.discard(block_hash.value)
        if written:
            with self._lock:
                self.stats.bytes_written += written
                self.stats.blocks_written += 1

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed)."""
        with self._lock:
            writes = list(self._writes)
        for fut in writes:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 (a write that failed is a block not on disk, nothing more)
                logger.exception("KV disk tier: a block write failed")

    def close(self) -> None:
        """Flush, then stop the worker threads."""
        self.flush()
        self._pool.shutdown(wait=True)
