"""The one JIT builder of kvserve's C kernels: compile a shared library with the system C compiler on first use,
into a cache folder shared by every process, atomically.

A library is named by a hash of its sources, headers, compiler and flags, so a changed source builds a new file
and concurrent processes share one build (the file appears whole or not at all, ``os.replace``). The compiler is
``$CC`` (default ``cc``); the folder is ``cache_root()``, or the temp folder when that is not writable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

#: The C sources of every kernel library.
CSRC = Path(__file__).with_name("csrc")


def cache_root() -> Path:
    """kvserve's cache folder: ``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``. It holds the compiled
    kernels, the packed-weight cache (``weights/``, ``kvserve.model.weight_cache``), the model-file hash memos
    (``hashes/``) and the converted tokenizers (``tokenizers/``); deleting it is always safe."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _cache_dirs() -> list[Path]:
    """Where a library may be built: ``cache_root()``, then the temp folder (a read-only home)."""
    return [cache_root(), Path(tempfile.gettempdir()) / f"kvserve-{os.getuid()}"]


def build_library(name: str, sources: Sequence[str], headers: Sequence[str], flags: Sequence[str]) -> Path:
    """The path of the shared library ``lib<name>_<hash>.so`` built from ``sources`` (file names in ``CSRC``),
    compiling it if no process has yet.

    Args:
        name: the library's name, e.g. ``"kvserve_cpu"``.
        sources: C files compiled into it; ``headers``: files they include (part of the hash only).
        flags: compiler flags (``-shared -fPIC`` and the optimisation and ISA flags).

    Raises:
        OSError: the compiler failed, or no cache folder is writable (the message names each folder's error).
        subprocess.SubprocessError: the compiler ran past 120 s.
    """
    cc = os.environ.get("CC", "cc")
    src_paths, hdr_paths = [CSRC / s for s in sources], [CSRC / h for h in headers]
    blob = b"".join(p.read_bytes() for p in src_paths + hdr_paths)
    tag = hashlib.sha256(blob + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        out = folder / f"lib{name}_{tag}.so"
        if out.exists():
            return out
        try:
            _compile(cc, src_paths, flags, out)
            return out
        except OSError as e:
            errors.append(f"{folder}: {e}")
    raise OSError("; ".join(errors))


def _compile(cc: str, sources: list[Path], flags: Sequence[str], out: Path) -> None:
    logger.info("first run: compiling %s (one-off)", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, out)  # atomic: another process sees either nothing or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
