"""kvserve's own float32 CPU matmul (``gemm_avx2.c``): built with the system C compiler on first use, loaded with
``ctypes``.

The shared library is compiled once per source version into ``$KVSERVE_CACHE_DIR`` (default
``~/.cache/kvserve``), atomically, so concurrent processes share it; the call costs ~1 s once. Nothing is built
where it cannot run: the CPU must report AVX2 (PyTorch's ``get_cpu_capability``) and a C compiler with OpenMP must
exist (``$CC``, default ``cc``). Set ``KVSERVE_CPU_GEMM=0`` to turn it off. When it is unavailable,
``kvserve.model.linear`` uses oneDNN or MKL instead; ``unavailable_reason()`` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

_SOURCE = Path(__file__).with_name("gemm_avx2.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
#: Output features per packed panel (``NR`` in gemm_avx2.c).
PANEL = 16

_lib = None
_reason: Optional[str] = None
_loaded = False


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _build() -> Path:
    src = _SOURCE.read_bytes()
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libkvserve_gemm_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, out)  # atomic: another process sees either nothing or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load():
    """The loaded library, or ``None`` when it cannot be used here (see ``unavailable_reason``). Cached."""
    global _lib, _reason, _loaded
    if _loaded:
        return _lib
    _loaded = True
    if os.environ.get("KVSERVE_CPU_GEMM", "1") == "0":
        _reason = "KVSERVE_CPU_GEMM=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _reason = f"CPU capability {torch.backends.cpu.get_cpu_capability()} (needs AVX2)"
    else:
        try:
            lib = ctypes.CDLL(str(_build()))
            lib.kvserve_gemm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
            lib.kvserve_gemm_f32.restype = None
            if lib.kvserve_gemm_panel() != PANEL:
                raise OSError("panel width mismatch between gemm_avx2.c and cpu_gemm.py")
            _lib = lib
        except (OSError, subprocess.SubprocessError) as e:
            _reason = f"build or load failed: {e}"
    return _lib


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` returned ``None``; ``None`` when the library is in use."""
    load()
    return _reason


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` float32 -> panels ``[ceil(N / 16), K, 16]`` (zero rows pad N up to a multiple of 16)."""
    n, k = weight.shape
    n_pad = -(-n // PANEL) * PANEL
    if n_pad != n:
        weight = torch.cat([weight, weight.new_zeros(n_pad - n, k)])
    return weight.reshape(n_pad // PANEL, PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K]`` float32 times the packed weight -> ``[M, out_features]`` float32 (``x @ W.T``).

    Requires ``load()`` to have returned the library. ``x`` is made contiguous if it is not.
    """
    x = x.contiguous()
    m, k = x.shape
    n_pad = packed.shape[0] * PANEL
    y = torch.empty(m, n_pad, dtype=torch.float32)
    if m:
        _lib.kvserve_gemm_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n_pad, k)
    return y if n_pad == out_features else y[:, :out_features]
