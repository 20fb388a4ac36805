"""The KV pool's element layouts: float32 and bfloat16 pools hold one element per value; an int8 pool
(``kv_cache_dtype="int8"``) holds each (token, KV head) row as its ``D`` int8 values followed by its scale, a
bfloat16 in two bytes, so one tensor ``[layers, 2, num_blocks, block_size, H_kv, D + 2]`` int8 keeps a block's
values and scales together (``pool[:, :, block_id]``: docs/design.md, "KV cache layout").

Quantization: symmetric absmax with one scale per row (the vector of one head of one token): ``s = bfloat16(max|x|
/ 127)``, ``q = clamp(round_half_even(x / s), -127, 127)``; read back as ``q * s``, which float32 holds exactly
(a 7-bit integer times an 8-bit significand). llama.cpp's q8_0 cache uses the same absmax form with a scale per 32
values (here a head's D values share one, so a row costs 2 bytes more than its values). A scale per (token, head)
rather than per token keeps each head's rows independent of the other heads, so a tensor-parallel rank, which holds
some of the heads, stores the bits a single process stores. The C kernels (``csrc/paged_attention.c``) write and read the same bits.
"""

from __future__ import annotations

import math

import torch

from kvserve.kernels.cpu import KV_SCALE_BYTES

#: The largest magnitude an int8 value takes (symmetric: -127 .. 127; -128 is never written).
INT8_QMAX = 127


def row_extra(dtype: torch.dtype) -> int:
    """Elements (bytes, for int8) each (token, KV head) row of a pool of ``dtype`` carries after its ``D`` values:
    2 for int8 (its bfloat16 scale), 0 otherwise."""
    return KV_SCALE_BYTES.get(dtype, 0)


def pool_shape(shape: tuple, dtype: torch.dtype) -> tuple:
    """The pool tensor's shape for the logical K/V shape ``shape`` (``[..., H_kv, D]``, as a model's
    ``kv_cache_shape`` gives) in ``dtype``: ``shape``, with ``D + 2`` last for int8."""
    shape = tuple(int(s) for s in shape)
    return shape[:-1] + (shape[-1] + row_extra(dtype),)


def pool_bytes(shape: tuple, dtype: torch.dtype) -> int:
    """Bytes a pool of the logical shape ``shape`` takes in ``dtype``, int8 scales included."""
    return math.prod(pool_shape(shape, dtype)) * torch.empty((), dtype=dtype).element_size()


def head_dim(kv_cache: torch.Tensor) -> int:
    """``D`` of a pool made for ``pool_shape`` (or any slice of it that keeps the last dimension)."""
    return kv_cache.shape[-1] - row_extra(kv_cache.dtype)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (float32, or widened to it) -> ``[..., D + 2]`` int8 rows as an int8 pool stores them: per
    row ``s = bfloat16(max|x| / 127)`` (float32 division, then round to nearest even), ``q = clamp(round_half_even(x
    / s), -127, 127)`` (float32 division), then ``s``'s two bytes (little-endian). A row of zeros (or one whose
    scale rounds to 0) stores zeros; a row with a NaN or an infinity stores ``q = 0`` and a NaN scale, so it reads
    as NaN, as a float cache passes such a value on. The kernels' write (``store_row_i8``) gives the same bits."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(amax)
    s = torch.where(finite, amax / INT8_QMAX, torch.full_like(amax, float("nan"))).to(torch.bfloat16)
    sf = s.float()
    ok = finite & (sf > 0)
    q = torch.round(x / torch.where(ok, sf, torch.ones_like(sf))).clamp(-INT8_QMAX, INT8_QMAX)
    q = torch.where(ok, q, torch.zeros_like(q))
    return torch.cat([q.to(torch.int8), s.view(torch.int8)], dim=-1)


def dequantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """``[..., D + 2]`` int8 rows (``quantize_int8``'s) -> ``[..., D]`` float32 ``q * s``, exact, the values the
    kernels compute with."""
    d = rows.shape[-1] - KV_SCALE_BYTES[torch.int8]
    s = rows[..., d:].contiguous().view(torch.bfloat16).float()
    return rows[..., :d].float() * s


def to_float(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows ``[..., D (+ 2)]`` of any pool dtype as ``dtype`` values ``[..., D]`` (int8: ``dequantize_int8``;
    others: a cast)."""
    return dequantize_int8(kv).to(dtype) if kv.dtype == torch.int8 else kv.to(dtype)


def from_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values ``[..., D]`` as pool rows of ``dtype`` (int8: ``quantize_int8``; others: PyTorch's cast, which
    rounds to nearest even)."""
    return quantize_int8(x) if dtype == torch.int8 else x.to(dtype)
