"""kvserve's own float32 CPU kernels (``csrc/``), one shared library built with the system C compiler on first
use and loaded with ``ctypes`` (which releases the GIL during a call):

- ``gemm_avx2.c``: the matmul of every projection (``kvserve.layers.linear``);
- ``paged_attention.c`` (+ ``paged_attention_isa.h`` once per instruction set, ``paged_attention_kv.h`` once per
  instruction set and cache type): attention of every query -- decode tokens, verification spans, prompt chunks of
  any length -- read in place from the KV blocks of a float32, bfloat16 or int8 cache, alone or with RoPE and the K/V
  write in the same call, with a reduction order fixed per query row (batch invariance; ``kvserve.attention.cpu``);
- ``elementwise.c``: one-pass RMSNorm (optionally after the residual add) and SwiGLU's silu(gate) * up
  (``kvserve.layers.elementwise``).

The library is compiled once per source version by ``kvserve.kernels.build`` (into ``$KVSERVE_CACHE_DIR``,
default ``~/.cache/kvserve``), so concurrent processes share it; the first build takes ~2 s. Nothing is built where it cannot run:
the CPU must report AVX2 (PyTorch's ``get_cpu_capability``) and a C compiler with OpenMP must exist (``$CC``,
default ``cc``). The engine argument ``cpu_kernels=False`` (``KernelConfig``) leaves it unused. Without it every
caller uses PyTorch ops (oneDNN/MKL matmuls, gather + SDPA attention), with the same results to float32 rounding;
``unavailable_reason()`` says why.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path
from typing import Optional

import torch

from kvserve.kernels.build import build_library

logger = logging.getLogger(__name__)

#: The library's sources and the headers they include (``kvserve.kernels.build``).
_SOURCES = ("gemm_avx2.c", "paged_attention.c", "elementwise.c")
_HEADERS = ("simd.h", "paged_attention_isa.h", "paged_attention_kv.h", "paged_attention_bf16.h",
            "amx_probe.h")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: Output features per packed panel (``NR`` in gemm_avx2.c).
PANEL = 16
#: KV-cache dtypes the attention kernels read and write -> the suffix of their C functions.
KV_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}
#: Bytes each (token, KV head) row of a cache of this dtype holds after its ``D`` values: an int8 row's bfloat16
#: scale (``kvserve.attention.kv_layout``; ``KV_EXTRA`` in paged_attention.c). Other dtypes: none.
KV_SCALE_BYTES = {torch.int8: 2}
#: The attention kernel's instruction-set builds -> the head widths (``D``) each takes: a multiple of this. ``amx``
#: is the AVX-512 build with a bfloat16 cache's scores on AMX-BF16 tiles (queries rounded to bfloat16; float32 and
#: int8 caches run the AVX-512 kernel under its names).
ATTENTION_ISAS = {"avx2": 8, "avx512": 16, "amx": 16}

_lib = None
_reason: Optional[str] = None
_loaded = False


def _build() -> Path:
    """The library's path, compiled on first use (``build_library``)."""
    return build_library("kvserve_cpu", _SOURCES, _HEADERS, _FLAGS)


def load():
    """The loaded library, or ``None`` when it cannot be used here (see ``unavailable_reason``). Cached."""
    global _lib, _reason, _loaded
    if _loaded:
        return _lib
    _loaded = True
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _reason = f"CPU capability {torch.backends.cpu.get_cpu_capability()} (needs AVX2)"
    else:
        try:
            lib = ctypes.CDLL(str(_build()))
            lib.kvserve_gemm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
            lib.kvserve_gemm_f32.restype = None
            lib.kvserve_gemm_w16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            lib.kvserve_gemm_w16.restype = None
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            for suffix in (f"{t}_{i}" for t in KV_SUFFIX.values() for i in ATTENTION_ISAS):
                attend = getattr(lib, "kvserve_paged_attention_" + suffix)
                attend.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 5 + [
                    ctypes.c_float, ptr, i64, i64, ctypes.c_float, ptr]  # scale, out, stride, window, softcap, sinks
                attend.restype = ctypes.c_int
                head = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 5 + [
                    ctypes.c_float, ptr, i64]
                fused = getattr(lib, "kvserve_rope_write_attend_" + suffix)
                fused.argtypes, fused.restype = head, ctypes.c_int
                fused_sw = getattr(lib, "kvserve_rope_write_attend_sw_" + suffix)
                fused_sw.argtypes, fused_sw.restype = head + [i64, ctypes.c_float], ctypes.c_int
                fused_sink = getattr(lib, "kvserve_rope_write_attend_sink_" + suffix)
                fused_sink.argtypes, fused_sink.restype = head + [i64, ctypes.c_float, ptr], ctypes.c_int
            lib.kvserve_attention_amx_usable.restype = ctypes.c_int
            lib.kvserve_rms_norm_f32.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
            lib.kvserve_add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
            lib.kvserve_silu_mul_f32.argtypes = [ptr, ptr, i64, i64]
            if lib.kvserve_gemm_panel() != PANEL:
                raise OSError("panel width mismatch between gemm_avx2.c and kernels/cpu.py")
            _lib = lib
        except (OSError, subprocess.SubprocessError) as e:
            _reason = f"build or load failed: {e}"
    return _lib


def attention_isa(cpu_isa: str = "auto") -> str:
    """The attention kernel's build for ``KernelConfig.cpu_isa``: ``"avx2"`` when forced (``cpu_isa="avx2"``) or
    when the CPU lacks AVX-512 (PyTorch's ``get_cpu_capability``); ``"amx"`` under ``"auto"`` or ``"amx_int8"``
    where the CPU has AMX-BF16 and Linux grants this process the tiles; else ``"avx512"``. The builds round
    differently (the softmax sum's lanes; AMX: bfloat16 queries and the tile unit's sums), so a forced ISA gives that
    ISA's bits on any CPU that runs it."""
    if cpu_isa == "avx2" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "avx2"
    if cpu_isa in ("auto", "amx_int8") and load() is not None and _lib.kvserve_attention_amx_usable():
        return "amx"
    return "avx512"


def attention_runs(isa: str, kv_dtype: torch.dtype) -> str:
    """The build whose code runs over a cache of ``kv_dtype`` under build ``isa`` (keys of ``ATTENTION_ISAS``):
    ``isa`` itself, except ``"avx512"`` for the AMX build over a float32 or int8 cache (its functions for those
    are the AVX-512 ones, paged_attention.c)."""
    return "avx512" if isa == "amx" and kv_dtype != torch.bfloat16 else isa


def attention_isas() -> list[str]:
    """Every attention build this CPU runs, in ``ATTENTION_ISAS``' order (``avx2`` first; the last is
    ``attention_isa()``'s choice): for tests and benchmarks that compare them."""
    chain = list(ATTENTION_ISAS)
    return chain[:chain.index(attention_isa()) + 1]


def attention_fn(kv_dtype: torch.dtype, isa: str, fused: bool = True, windowed: bool = False,
                 sinks: bool = False):
    """The library's ``kvserve_rope_write_attend_<type>_<isa>`` (``fused``; ``..._sw_...`` with ``windowed``: it
    takes a sliding window and a soft-cap after the others; ``..._sink_...`` with ``sinks``: those and a pointer to
    the per-head sink logits) or ``kvserve_paged_attention_<...>`` function (window, soft-cap, sinks last) for a
    cache of ``kv_dtype`` (a key of ``KV_SUFFIX``) and an ``ATTENTION_ISAS`` build."""
    fused_name = ("kvserve_rope_write_attend_sink_" if sinks else "kvserve_rope_write_attend_sw_" if windowed
                  else "kvserve_rope_write_attend_")
    name = fused_name if fused else "kvserve_paged_attention_"
    return getattr(_lib, f"{name}{KV_SUFFIX[kv_dtype]}_{isa}")


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` returned ``None``; ``None`` when the library is in use."""
    load()
    return _reason


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (float32, float16 or bfloat16) -> panels ``[ceil(N / 16), K, 16]`` of its dtype (zero rows
    pad N up to a multiple of 16)."""
    n, k = weight.shape
    n_pad = -(-n // PANEL) * PANEL
    if n_pad != n:
        weight = torch.cat([weight, weight.new_zeros(n_pad - n, k)])
    return weight.reshape(n_pad // PANEL, PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K]`` float32 times the packed weight -> ``[M, out_features]`` float32 (``x @ W.T``). ``packed``:
    ``pack``'s float32 panels, or float16 / bfloat16 ones (the weight kept in 16 bits, widened in registers: the
    outputs equal the float32 panels' of the widened weight, bit for bit).

    Requires ``load()`` to have returned the library. ``x`` is made contiguous if it is not.
    """
    x = x.contiguous()
    m, k = x.shape
    n_pad = packed.shape[0] * PANEL
    y = torch.empty(m, n_pad, dtype=torch.float32)
    if m and packed.dtype == torch.float32:
        _lib.kvserve_gemm_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n_pad, k)
    elif m:
        _lib.kvserve_gemm_w16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n_pad, k,
                              int(packed.dtype == torch.bfloat16))
    return y if n_pad == out_features else y[:, :out_features]


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, q_start: torch.Tensor,
                    q_len: torch.Tensor, seq_len: torch.Tensor, scale: float, out: torch.Tensor,
                    isa: str = "avx2", sliding_window: Optional[int] = None,
                    logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> bool:
    """Causal attention of B requests' query rows over their paged K/V, written into ``out`` (``paged_attention.c``:
    each row's result depends only on its query and the keys and values in its window up to its position, never on
    the other rows, the batch or the thread count).

    Args:
        q: ``[T, H_q, D]`` float32 (rows may be strided; each head's D floats contiguous).
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` float32 or bfloat16, or ``[..., H_kv, D + 2]`` int8
            (values, then each row's scale: ``KV_SCALE_BYTES``) (``KV_SUFFIX``) contiguous, one layer.
        block_tables: ``[B, max_blocks]`` int64 contiguous.
        q_start, q_len, seq_len: ``[B]`` int64: request b's rows are ``q_start[b] .. + q_len[b]``; it has
            ``seq_len[b]`` keys, this step's included.
        out: ``[T, H_q, D]`` float32 contiguous; only the requests' rows are written.
        isa: the kernel's build, a key of ``ATTENTION_ISAS`` this CPU runs (``attention_isa``).
        sliding_window: the row at position ``p`` sees keys ``p - sliding_window < j <= p`` (Hugging Face's
            meaning); ``None``: every key up to ``p``.
        logit_softcap: scores ``s`` become ``logit_softcap * tanh(s / logit_softcap)`` before the softmax (Gemma 2);
            ``None``: no cap.
        sinks: ``[H_q]`` float32 contiguous: each query head's attention-sink logit, one more term of every row's
            softmax denominator that weighs no value (gpt-oss); ``None``: none.

    Returns:
        ``False`` (nothing written) when the kernel cannot take these tensors (dtype, layout, D not a multiple of
        ``ATTENTION_ISAS[isa]``, sinks not ``[H_q]`` float32 contiguous) or could not allocate scratch memory.
    """
    t, h_q, d = q.shape
    _, _, bs, h_kv, row = kv_cache.shape
    if (q.dtype != torch.float32 or kv_cache.dtype not in KV_SUFFIX or not kv_cache.is_contiguous()
            or row != d + KV_SCALE_BYTES.get(kv_cache.dtype, 0)
            or d % ATTENTION_ISAS[isa] or h_q % h_kv or q.stride(2) != 1 or q.stride(1) != d
            or not out.is_contiguous() or not _sinks_ok(sinks, h_q)):
        return False
    b, max_blocks = block_tables.shape
    rc = attention_fn(kv_cache.dtype, isa, fused=False)(
        q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
        max_blocks, q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(), b, h_q, h_kv, d, bs, scale,
        out.data_ptr(), out.stride(0), *mask_args(sliding_window, logit_softcap),
        None if sinks is None else sinks.data_ptr())
    return rc == 0


def _sinks_ok(sinks: Optional[torch.Tensor], num_heads: int) -> bool:
    """Whether ``sinks`` is ``None`` or the kernels' ``[num_heads]`` float32 contiguous per-head logits."""
    return sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()
                             and tuple(sinks.shape) == (num_heads,))


def mask_args(sliding_window: Optional[int], logit_softcap: Optional[float]) -> tuple[int, float]:
    """The kernels' ``(window, softcap)`` arguments: 0 for "none" (callers check the values:
    ``kvserve.attention.base.check_mask``)."""
    return int(sliding_window or 0), float(logit_softcap or 0.0)


class RopeWriteAttend:
    """One step's attention layers after their fused Q/K/V projections, one kernel call per layer
    (``kvserve_rope_write_attend_<type>_<isa>``): RoPE (rotate-half) on the query and key heads of ``qkv`` in
    place, every row's K/V written to its cache slot, then paged attention of ``requests``. Everything that is the
    same for every layer of the step is checked and resolved here once, so a layer's call costs little Python.

    Args:
        num_heads: ``H_q``, a multiple of ``H_kv``.
        kv_shape: a layer's cache shape ``(2, num_blocks, block_size, H_kv, D)`` (int8: ``D + 2``,
            ``KV_SCALE_BYTES``).
        kv_dtype: the cache's dtype, a key of ``KV_SUFFIX`` (float32, bfloat16 or int8; another: ``ok`` is
            ``False``).
        cos, sin: ``[T, D]`` float32 contiguous (any view of such, e.g. ``[T, 1, D]``): the rotation of each row.
        slot_mapping: ``[T]`` int64 contiguous, each row's cache slot.
        requests: ``(block_tables [B, max_blocks], q_start [B], q_len [B], seq_len [B])`` int64 contiguous, the
            requests to attend (as ``paged_attention``), or ``None`` for none.
        scale: softmax scale.
        isa: the kernel's build, a key of ``ATTENTION_ISAS`` this CPU runs (``attention_isa``).
        sliding_window, logit_softcap: as ``paged_attention``'s (the same for every layer that uses this plan).
        sinks: the layers take attention sinks (``paged_attention``'s; each call passes its layer's).

    Attributes:
        ok: whether the kernel can take this step (float32 tables, ``D`` a multiple of the build's width, ...); when
            ``False``, calls return ``None``. The tensors must stay alive while the plan is used.
    """

    def __init__(self, num_heads: int, kv_shape: tuple, kv_dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, requests: Optional[tuple], scale: float, isa: str = "avx2",
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None, sinks: bool = False):
        t = slot_mapping.shape[0]
        _, _, bs, h_kv, row = kv_shape
        d = row - KV_SCALE_BYTES.get(kv_dtype, 0)
        tensors = (slot_mapping,) + (requests or ())
        self.ok = (_lib is not None and kv_dtype in KV_SUFFIX and cos.dtype == sin.dtype == torch.float32
                   and d % ATTENTION_ISAS[isa] == 0 and num_heads % h_kv == 0
                   and cos.numel() == sin.numel() == t * d and cos.is_contiguous() and sin.is_contiguous()
                   and all(x.dtype == torch.int64 and x.is_contiguous() for x in tensors))
        self.kv_shape, self.num_heads, self.t = tuple(kv_shape), num_heads, t
        self.qkv_shape = (t, (num_heads + 2 * h_kv) * d)
        self.out_shape = (t, num_heads * d)
        self.kv_dtype = kv_dtype
        self._kv_half = kv_shape[1] * bs * h_kv * row * kv_dtype.itemsize  # bytes from a layer's K to its V
        self.isa = isa
        mask = mask_args(sliding_window, logit_softcap)
        self._fn = attention_fn(kv_dtype, isa, windowed=mask != (0, 0), sinks=sinks) if self.ok else None
        tables, q_start, q_len, seq_len = requests or (slot_mapping,) * 4  # not read without requests
        b, max_blocks = (0, 0) if requests is None else tables.shape
        self._head = (t, cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr())
        self._tail = (tables.data_ptr(), max_blocks, q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(), b,
                      num_heads, h_kv, d, bs, scale)
        self._mask = mask if mask != (0, 0) or sinks else ()
        self._sinks = sinks

    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor, out: Optional[torch.Tensor] = None,
                 sinks: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, bool]]:
        """One layer: ``qkv [T, (H_q + 2 H_kv) * D]`` float32 (rows may be strided, ``stride(1) == 1``; its query
        and key heads are rotated in place), ``kv_cache`` that layer's ``kv_shape`` in ``kv_dtype``, contiguous (its
        keys and values are rounded to ``kv_dtype`` as PyTorch's cast rounds, or quantized as
        ``kv_layout.quantize_int8``); ``out``: an
        ``[T, H_q * D]`` float32 contiguous tensor to write into (default: a new one); ``sinks``: the layer's
        ``[H_q]`` float32 contiguous sink logits (a plan made with ``sinks``; ``None``: none).

        Returns:
            ``(out, True)``: ``out [T, H_q * D]`` float32 holds the requests' rows (others unwritten); ``(out,
            False)``: RoPE and the K/V write are done but the attention could not allocate scratch memory (attend
            another way from the rotated ``qkv``); ``None``: nothing done, the kernel cannot take these tensors.
        """
        if not (self.ok and qkv.dtype == torch.float32 and qkv.shape == self.qkv_shape and qkv.stride(1) == 1
                and kv_cache.dtype == self.kv_dtype and kv_cache.shape == self.kv_shape and kv_cache.is_contiguous()
                and (sinks is None or self._sinks) and _sinks_ok(sinks, self.num_heads)):
            return None
        if out is None or not _out_ok(out, self.out_shape):
            out = torch.empty(self.out_shape, dtype=torch.float32)
        k = kv_cache.data_ptr()
        rc = self._fn(qkv.data_ptr(), qkv.stride(0), *self._head, k, k + self._kv_half, *self._tail, out.data_ptr(),
                      self.out_shape[1], *self._mask, *((None if sinks is None else sinks.data_ptr(),) if self._sinks
                                                        else ()))
        return out, rc == 0


def _out_ok(out: torch.Tensor, shape: tuple) -> bool:
    return out.dtype == torch.float32 and out.shape == shape and out.is_contiguous()


def _rows_ok(*tensors) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.shape[-1] % 8 == 0 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """RMSNorm of ``x [T, H]`` float32 with ``weight [H]`` -> ``[T, H]``, in one pass; ``None`` when the kernel
    cannot take these tensors (dtype, layout, H not a multiple of 8)."""
    if not _rows_ok(x, weight):
        return None
    y = torch.empty_like(x)
    _lib.kvserve_rms_norm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """A decoder's residual add and the next RMSNorm in one pass: ``h += delta`` in place, returns
    ``rms_norm(h) * weight`` (in ``out`` when it is a ``[T, H]`` float32 contiguous tensor, else a new one).
    ``h``, ``delta``: ``[T, H]`` float32 contiguous; ``weight [H]``. ``None`` (nothing done, ``h`` unchanged) when the
    kernel cannot take these tensors."""
    f32 = torch.float32
    t, hidden = h.shape
    if not (h.dtype == delta.dtype == weight.dtype == f32 and delta.shape == h.shape and hidden % 8 == 0
            and h.is_contiguous() and delta.is_contiguous() and weight.is_contiguous() and weight.shape[0] == hidden):
        return None
    y = out if out is not None and _out_ok(out, h.shape) else torch.empty(t, hidden, dtype=f32)
    _lib.kvserve_add_rms_norm_f32(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), y.data_ptr(), t, hidden, eps)
    return y


def silu_mul(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """SwiGLU's ``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) float32 -> ``[T, I]`` (in ``out`` when it is
    such a float32 contiguous tensor, else a new one); ``None`` when the kernel cannot take it."""
    t, i2 = gate_up.shape
    if not (gate_up.dtype == torch.float32 and i2 % 16 == 0 and gate_up.is_contiguous()):
        return None
    y = out if out is not None and _out_ok(out, (t, i2 // 2)) else torch.empty(t, i2 // 2, dtype=torch.float32)
    _lib.kvserve_silu_mul_f32(gate_up.data_ptr(), y.data_ptr(), t, i2 // 2)
    return y
