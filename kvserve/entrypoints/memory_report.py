"""Where this process's resident memory goes: peak RSS by stage and a breakdown (``kvserve generate
--report-memory``; docs/performance.md, "Start-up and memory").

Linux only (``/proc``); elsewhere ``MemoryProbe`` and ``rss_breakdown`` return ``None`` values. Terms, in bytes:

- **peak RSS**: ``VmHWM`` of ``/proc/self/status``, the most resident memory the process has held -- what
  ``/usr/bin/time -v`` prints as "Maximum resident set size". ``MemoryProbe.mark`` resets it after reading
  (``/proc/self/clear_refs``, value 5), so each stage reports its own peak; the process's is their maximum.
- **anonymous**: the ``Anonymous:`` pages of every mapping in ``/proc/self/smaps``: the heap (Python objects,
  PyTorch's allocations, the tokenizer), the KV pool's written pages, and pages of libraries that were written
  (relocations, static data). **file-backed**: ``Rss - Anonymous``: clean pages of mapped files -- the libraries'
  code and read-only data, the packed-weight cache entry (``*.kvpack``) and the GGUF file (``*.gguf``).
- **KV pool touched**: pages inside the pool tensors' address range that hold a page of their own
  (``/proc/self/pagemap``: present and mapped exclusively). A never-written page of the lazily allocated pool
  (``kvserve.worker.kv_pool.lazy_zeros``) is absent, or, once read, the kernel's shared zero page, which RSS does
  not count either. Part of **anonymous**.

Algorithm source: proc(5) (``smaps``, ``status``, ``clear_refs``) and the kernel's
``Documentation/admin-guide/mm/pagemap.rst`` (bit 63 present, bit 56 exclusively mapped).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
_PRESENT, _EXCLUSIVE = 1 << 63, 1 << 56

#: Breakdown kinds, in print order, and how a mapping's path picks one (first match).
KINDS = ("weights", "libraries", "other files", "heap and anonymous")


@dataclass
class Mapping:
    """One entry of ``/proc/<pid>/smaps``: address range ``[start, end)``, ``path`` (``""`` for anonymous
    memory, ``[heap]``, ``[stack]``, ...), ``rss`` and ``anonymous`` bytes."""

    start: int
    end: int
    path: str
    rss: int = 0
    anonymous: int = 0

    @property
    def kind(self) -> str:
        """``"weights"`` (``.kvpack`` / ``.gguf``), ``"libraries"`` (``.so`` files), ``"other files"`` or
        ``"heap and anonymous"``."""
        p = self.path.removesuffix(" (deleted)")
        if p.endswith((".kvpack", ".gguf")):
            return "weights"
        if p.startswith("/") and (".so" in os.path.basename(p)):
            return "libraries"
        if p.startswith("/"):
            return "other files"
        return "heap and anonymous"


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/<pid>/smaps`` text, with their ``Rss`` and ``Anonymous`` (kB -> bytes)."""
    out: list[Mapping] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3).strip()))
            continue
        if out and (line.startswith("Rss:") or line.startswith("Anonymous:")):
            kb = int(line.split()[1]) * 1024
            if line.startswith("Rss:"):
                out[-1].rss = kb
            else:
                out[-1].anonymous = kb
    return out


def _status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); ``False`` where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def touched_bytes(ranges: Iterable[tuple[int, int]], pagemap: str = "/proc/self/pagemap") -> Optional[int]:
    """Bytes of the pages in the address ``ranges`` (``[start, end)``) that hold a page of their own (present and
    exclusively mapped in ``pagemap``); ``None`` when ``pagemap`` cannot be read."""
    import numpy as np

    total = 0
    try:
        with open(pagemap, "rb", buffering=0) as f:
            for start, end in ranges:
                first, last = start // _PAGE, -(-end // _PAGE)
                step = 1 << 16  # pages per read (512 KiB of entries)
                for p in range(first, last, step):
                    n = min(step, last - p)
                    f.seek(p * 8)
                    entries = np.frombuffer(f.read(n * 8), dtype=np.uint64)
                    both = np.uint64(_PRESENT | _EXCLUSIVE)
                    total += int(np.count_nonzero((entries & both) == both))
    except OSError:
        return None
    return total * _PAGE


def tensor_ranges(tensors: Iterable) -> list[tuple[int, int]]:
    """``[start, end)`` address ranges of CPU tensors' storages (e.g. the KV pool)."""
    out = []
    for t in tensors:
        if t is None or t.device.type != "cpu" or t.numel() == 0:
            continue
        st = t.untyped_storage()
        out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


@dataclass
class Stage:
    """One ``MemoryProbe.mark``: RSS at its end and the peak during it (bytes; ``None`` when unknown)."""

    name: str
    rss: Optional[int]
    peak: Optional[int]


@dataclass
class MemoryProbe:
    """Records the peak RSS of consecutive stages of this process.

    ``mark(name)`` ends a stage: it reads ``VmRSS`` and ``VmHWM`` (the peak since the previous mark, or since the
    process started for the first) and resets the peak. If the reset is not allowed, each stage's peak is the
    process's peak so far (``per_stage`` ``False``).
    """

    stages: list[Stage] = field(default_factory=list)
    per_stage: bool = True

    def mark(self, name: str) -> Stage:
        """End the stage ``name`` and return it."""
        rss, peak = _status_kib("VmRSS"), _status_kib("VmHWM")
        stage = Stage(name, None if rss is None else rss * 1024, None if peak is None else peak * 1024)
        self.stages.append(stage)
        self.per_stage = _reset_peak() and self.per_stage
        return stage

    @property
    def peak(self) -> Optional[int]:
        """The process's peak RSS over the marked stages (bytes)."""
        peaks = [s.peak for s in self.stages if s.peak is not None]
        return max(peaks) if peaks else None


def rss_breakdown(pool_tensors: Iterable = (), smaps: str = "/proc/self/smaps") -> dict:
    """This process's resident memory now, by kind (see the module docstring).

    Args:
        pool_tensors: the KV pool tensors (their touched pages are counted as ``kv_pool_touched``).
        smaps: the ``smaps`` file to read.

    Returns:
        ``{"rss", "anonymous", "file_backed", "kv_pool_bytes" (the pools' size), "kv_pool_touched",
        "by_kind": {kind: {"rss", "anonymous"}}, "largest": [(path, rss), ...] (the 8 largest files)}``, bytes;
        every value ``None`` when ``smaps`` cannot be read.
    """
    ranges = tensor_ranges(pool_tensors)
    pool_bytes = sum(e - s for s, e in ranges)
    try:
        with open(smaps) as f:
            maps = parse_smaps(f.read())
    except OSError:
        return {"rss": None, "anonymous": None, "file_backed": None, "kv_pool_bytes": pool_bytes,
                "kv_pool_touched": None, "by_kind": {}, "largest": []}
    by_kind = {k: {"rss": 0, "anonymous": 0} for k in KINDS}
    by_path: dict[str, int] = {}
    for m in maps:
        by_kind[m.kind]["rss"] += m.rss
        by_kind[m.kind]["anonymous"] += m.anonymous
        if m.path.startswith("/"):
            by_path[m.path] = by_path.get(m.path, 0) + m.rss
    rss = sum(m.rss for m in maps)
    anon = sum(m.anonymous for m in maps)
    largest = sorted(by_path.items(), key=lambda kv: -kv[1])[:8]
    return {"rss": rss, "anonymous": anon, "file_backed": rss - anon, "kv_pool_bytes": pool_bytes,
            "kv_pool_touched": touched_bytes(ranges) if ranges else 0, "by_kind": by_kind, "largest": largest}


def memory_report(probe: MemoryProbe, pool_tensors: Iterable = ()) -> dict:
    """The peak RSS, each stage's end RSS and peak, and the breakdown now (``rss_breakdown``), as one
    JSON-able dict (bytes)."""
    return {"peak_rss": probe.peak, "per_stage_peaks": probe.per_stage,
            "stages": [{"name": s.name, "rss": s.rss, "peak": s.peak} for s in probe.stages],
            **rss_breakdown(pool_tensors)}


def format_memory(r: dict) -> str:
    """``memory_report``'s dict as the lines ``kvserve generate --report-memory`` prints, in MiB (``/usr/bin/time
    -v``'s "Maximum resident set size" in kB / 1024)."""
    mb = lambda v: "n/a" if v is None else f"{v / 2**20:.1f} MiB"  # noqa: E731
    lines = [f"peak RSS                 {mb(r['peak_rss'])}"]
    for s in r["stages"]:
        what = "peak" if r["per_stage_peaks"] else "peak so far"
        lines.append(f"  {s['name']:<22} {what} {mb(s['peak'])}, then {mb(s['rss'])}")
    lines.append(f"RSS at the end           {mb(r['rss'])}: anonymous {mb(r['anonymous'])}, "
                 f"file-backed {mb(r['file_backed'])}")
    for kind, v in r["by_kind"].items():
        lines.append(f"  {kind:<22} {mb(v['rss'])} ({mb(v['anonymous'])} anonymous)")
    lines.append(f"KV pool touched          {mb(r['kv_pool_touched'])} of {mb(r['kv_pool_bytes'])} mapped")
    lines += [f"  {mb(n):>10}  {p}" for p, n in r["largest"]]
    return "\n".join(lines)
