"""A content-addressed store of KV blocks in a directory: the prefix cache's disk tier (docs/design.md, "KV tiers").

An entry is one full block's K/V, keyed by its chained ``BlockHash`` (``block_pool.hash_block``: sha256 over the
parent's hash and the block's token ids, so a key names the whole prefix up to and including the block) under a
*fingerprint*: a sha256 of everything that changes the bits of K/V (model file, quantization, activation precision,
KV dtype, block size, kernel instruction set, model shape, code version; ``kvserve.engine.kv_tier_setup``).

Layout: ``<dir>/<fingerprint, 32 hex>/<key, first 2 hex>/<key, 64 hex>.kvb``. A file is::

    header (ENTRY_HEADER, little-endian): magic b"KVSBLK01", fingerprint (32 bytes), key (32), parent key (32),
        number of token ids (uint32), payload bytes (uint64), CRC-32 of everything after the header + the header
        before this field (uint32)
    the block's token ids (int64 each)
    the payload: the block's slices of the KV tensors, as the model runner copies them out

Guarantees:

- **Atomic**: written to a temporary file in the entry's folder, then ``os.replace``-d: a reader sees nothing or a
  whole entry, and two processes writing the same key write the same bytes.
- **Verified**: ``get`` checks the size, the magic, the fingerprint, the key, the parent key, the token ids (equal
  to the ones looked up, as ``BlockPool.lookup`` compares them) and the CRC; a torn, truncated, foreign or
  corrupted entry is a miss, logged and deleted, never used.
- **Bounded**: least recently used first out by bytes over the whole directory (every fingerprint). A hit sets the
  file's modification time (one ``utime``), the LRU clock. When this process's estimate of the directory's bytes
  passes the budget, or every ``RESCAN_FRACTION`` of the budget it wrote (so other processes' writes are seen), one
  process at a time (an ``flock`` on ``<dir>/.lock``; the others try again at their next write) lists the entries and deletes the oldest until
  the total is under ``LOW_WATERMARK`` of the budget. Deleting a file another process is reading is safe on POSIX
  (its open file keeps the bytes); a reader that finds it gone has a miss.
- **Degrades**: a write that fails (full disk, quota, permissions) turns writes off for the rest of the process,
  with one warning; reads of the entries already there go on (they are verified anyway).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from array import array
from pathlib import Path
from typing import Optional, Sequence

from kvserve.core.block_pool import BlockHash

logger = logging.getLogger(__name__)

ENTRY_MAGIC = b"KVSBLK01"
#: magic, fingerprint, key, parent key, number of token ids, payload bytes, CRC-32.
ENTRY_HEADER = struct.Struct("<8s32s32s32sIQI")
ENTRY_SUFFIX = ".kvb"
#: The eviction pass deletes entries until the directory holds at most this share of the budget.
LOW_WATERMARK = 0.9
#: Each process lists the directory again after writing this share of the budget (other processes' writes).
RESCAN_FRACTION = 0.05
#: Temporary files older than this (seconds) are a crashed writer's and are deleted by the eviction pass.
STALE_TMP_SECONDS = 600.0


def _write_all(fd: int, chunks: Sequence) -> None:
    """Write every bytes-like chunk to ``fd`` (raises ``OSError`` as the file system does: ENOSPC, EDQUOT, ...)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]


class DiskBlockStore:
    """The entries of one fingerprint in ``root``, with the directory's byte budget.

    Args:
        root: the directory (created if missing).
        fingerprint: 32 bytes, what the entries' K/V bits depend on (module docstring).
        capacity_bytes: the budget of the whole directory, bytes.

    Attributes:
        write_enabled: false once a write failed (module docstring, "Degrades").
        num_evicted, bytes_evicted: entries deleted by this process's eviction passes.
        num_bad_entries: entries ``get`` found bad (and deleted).

    Raises:
        ValueError: ``root`` cannot be created or written (names the directory and the error), or a bad argument.
    """

    def __init__(self, root, fingerprint: bytes, capacity_bytes: int):
        if len(fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.dir = self.root / fingerprint.hex()[:32]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=self.dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"kv_disk_cache_dir {str(self.root)!r} cannot be used: {e}") from e
        self.write_enabled = True
        self.num_evicted = 0
        self.bytes_evicted = 0
        self.num_bad_entries = 0
        self._lock = threading.Lock()  # guards the byte estimate (writer threads)
        self._written_since_scan = 0
        total = self.evict()
        self._estimate = total if total is not None else self._list()[1]  # (another process is in its pass)

    def path(self, key: bytes) -> Path:
        """The file of the entry with key ``key`` (32 bytes)."""
        h = key.hex()
        return self.dir / h[:2] / (h + ENTRY_SUFFIX)

    def contains(self, block_hash: BlockHash) -> bool:
        """An entry file for the block exists (it is verified only when read)."""
        return os.path.exists(self.path(block_hash.value))

    def put(self, block_hash: BlockHash, payload: Sequence) -> int:
        """Write the entry of ``block_hash`` with ``payload`` (bytes-like chunks, concatenated) unless it exists or
        writes are off. Returns the bytes written (0 if nothing was). Never raises on an I/O error: writes are
        turned off instead (one warning)."""
        if not self.write_enabled:
            return 0
        path = self.path(block_hash.value)
        if os.path.exists(path):
            return 0
        tokens = array("q", block_hash.token_ids)
        n_payload = sum(memoryview(c).nbytes for c in payload)
        head = ENTRY_HEADER.pack(ENTRY_MAGIC, self.fingerprint, block_hash.value, block_hash.parent.rjust(32, b"\0"),
                                 len(tokens), n_payload, 0)[:-4]
        crc = zlib.crc32(head)
        crc = zlib.crc32(tokens, crc)
        for c in payload:
            crc = zlib.crc32(c, crc)
        chunks = [head, struct.pack("<I", crc), tokens, *payload]
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
            try:
                _write_all(fd, chunks)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            self._disable_writes(e)
            return 0
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        size = ENTRY_HEADER.size + tokens.itemsize * len(tokens) + n_payload
        self._account(size)
        return size

    def get(self, block_hash: BlockHash, payload_bytes: int) -> Optional[memoryview]:
        """The payload of ``block_hash``'s entry if it exists and is whole and exactly this block's (module
        docstring, "Verified"); ``None`` otherwise (a bad entry is logged and deleted). A hit marks the entry
        recently used."""
        path = self.path(block_hash.value)
        n_tokens = len(block_hash.token_ids)
        body = 8 * n_tokens + payload_bytes
        size = ENTRY_HEADER.size + body
        try:
            with open(path, "rb") as f:
                buf = bytearray(size + 1)
                n = f.readinto(buf)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("KV disk tier: cannot read %s: %s (recomputing the block)", path, e)
            return None
        problem = self._check(buf, n, size, block_hash, payload_bytes)
        if problem is not None:
            logger.warning("KV disk tier: entry %s is %s; deleted, the block is recomputed", path, problem)
            self.num_bad_entries += 1
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the bytes read are whole and verified
        return memoryview(buf)[size - payload_bytes : size]

    def _check(self, buf: bytearray, n: int, size: int, block_hash: BlockHash, payload_bytes: int) -> Optional[str]:
        """Why the ``n`` bytes read are not ``block_hash``'s entry of ``size`` bytes, or ``None`` if they are."""
        if n != size:
            return f"{n} bytes, not {size} (truncated or of another layout)"
        magic, fp, key, parent, n_tokens, n_payload, crc = ENTRY_HEADER.unpack_from(buf)
        if magic != ENTRY_MAGIC:
            return "not an entry (bad magic)"
        if fp != self.fingerprint:
            return "of another fingerprint (model, quantization, KV dtype, block size or kernel)"
        if key != block_hash.value or parent != block_hash.parent.rjust(32, b"\0"):
            return "of another block (key)"
        if n_tokens != len(block_hash.token_ids) or n_payload != payload_bytes:
            return "of another shape"
        view = memoryview(buf)[:size]
        got = zlib.crc32(view[ENTRY_HEADER.size :], zlib.crc32(view[: ENTRY_HEADER.size - 4]))
        if got != crc:
            return "corrupted (checksum mismatch)"
        if view[ENTRY_HEADER.size : ENTRY_HEADER.size + 8 * n_tokens] != array("q", block_hash.token_ids).tobytes():
            return "of other token ids"
        return None

    def _disable_writes(self, e: OSError) -> None:
        if self.write_enabled:
            self.write_enabled = False
            what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}.get(e.errno, "")
            logger.warning("KV disk tier: a write to %s failed (%s%s); no more blocks are written by this process, "
                           "entries already there are still read", self.dir, what + ": " if what else "", e)

    def _account(self, size: int) -> None:
        """Count ``size`` bytes written; run an eviction pass when the budget or the rescan interval is reached
        (retried at the next write while another process holds the pass)."""
        with self._lock:
            self._estimate += size
            self._written_since_scan += size
            due = (self._estimate > self.capacity_bytes
                   or self._written_since_scan > RESCAN_FRACTION * self.capacity_bytes)
        if due:
            total = self.evict()
            if total is not None:
                with self._lock:
                    self._estimate = total
                    self._written_since_scan = 0

    def evict(self) -> Optional[int]:
        """One eviction pass over the whole directory (module docstring, "Bounded"): delete the least recently used
        entries until at most ``LOW_WATERMARK`` of the budget is left, if the budget is exceeded, and stale
        temporary files. Returns the bytes of entries left (this process's new estimate), or ``None`` when
        another process is evicting (nothing was done)."""
        try:
            lock = os.open(self.root / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None
            entries, total = self._list()
            if total > self.capacity_bytes:
                entries.sort()
                target = LOW_WATERMARK * self.capacity_bytes
                for _, size, path in entries:
                    if total <= target:
                        break
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        continue
                    total -= size
                    self.num_evicted += 1
                    self.bytes_evicted += size
            return total
        finally:
            os.close(lock)  # (releases the lock)

    def _list(self) -> tuple[list, int]:
        """``[(mtime_ns, size, path)]`` of every entry under the root and their total bytes; stale temporary files
        are deleted on the way."""
        entries, total = [], 0
        now = time.time()
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                if name.endswith(ENTRY_SUFFIX):
                    entries.append((st.st_mtime_ns, st.st_size, p))
                    total += st.st_size
                elif name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
        return entries, total

    @property
    def bytes_estimate(self) -> int:
        """This process's estimate of the directory's entry bytes (exact after an eviction pass)."""
        return self._estimate
