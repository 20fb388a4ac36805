"""Simple quantizers for GGUF's Q6_K and Q5_K (``gguf.quants.quantize`` does not implement the K-quants), for
tests and benchmarks that need files in those formats: round-to-nearest with the scales taken from each sub-block's
extremes, not llama.cpp's scale search (``ggml-quants.c`` ``make_qx_quants`` / ``make_qkx2_quants``), so a little
less accurate than llama.cpp's files; the block layouts are the GGUF spec's (``formats.py``), so
``formats.dequantize`` / ``gguf.quants.dequantize`` read what these write.

Both take float32 ``[N, K]`` (K a multiple of 256) and return the file's bytes, ``uint8 [N, K / 256 * block bytes]``.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _superblocks(w: np.ndarray, sub: int) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quant rows need float32 [N, K] with K a multiple of {QK_K}, got {list(w.shape)}")
    n, k = w.shape
    return w.reshape(n, k // QK_K, QK_K // sub, sub)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[N, K]`` -> Q6_K rows (210 bytes per 256 values): per 16 values the signed extreme maps to -32
    (scale ``extreme / -32``), the 16 scales to int8 against ``d = extreme scale / -128`` (float16), then
    ``q = rint(w / (d * sc))`` in -32..31, stored + 32.

    Raises:
        ValueError: ``w`` not 2-D with K a multiple of 256.
    """
    x = _superblocks(w, 16)  # [n, nb, 16, 16]
    n, nb = x.shape[:2]
    ext = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # [n, nb, 16]
    scale = ext / np.float32(-32)
    ms = np.take_along_axis(scale, np.abs(scale).argmax(-1)[..., None], -1)[..., 0]  # [n, nb]
    d = (ms / np.float32(-128)).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[..., None])), -128, 127).astype(np.int8)
    ds = d.astype(np.float32)[..., None] * sc.astype(np.float32)  # [n, nb, 16], as the decoder multiplies
    q = (np.clip(np.rint(_safe_div(x, ds[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, nb, QK_K)
    lo = (q & 0x0F).reshape(n, nb, 2, 2, 64)  # value e = 128 h + 64 s + i: nibble s of ql[64 h + i]
    ql = (lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).reshape(n, nb, 128)
    hi = (q >> 4).reshape(n, nb, 2, 4, 32)  # value e = 128 h + 32 s + i: bits 2 s of qh[32 h + i]
    qh = (hi[:, :, :, 0] | hi[:, :, :, 1] << 2 | hi[:, :, :, 2] << 4 | hi[:, :, :, 3] << 6).reshape(n, nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, nb, 1).view(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.astype(np.uint8)).reshape(n, -1)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins ``[..., 8]`` -> the 12 bytes of Q4_K / Q5_K (inverse of ``formats._k_scales``)."""
    a = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 ``[N, K]`` -> Q5_K rows (176 bytes per 256 values): per 32 values ``w ~= d sc q - dmin mn`` with
    ``mn`` from the sub-block's minimum (clamped at 0) and ``sc`` from its range over 31; the 6-bit ``sc``, ``mn``
    against float16 ``d``, ``dmin`` = their largest / 63; ``q = rint((w + dmin mn) / (d sc))`` in 0..31.

    Raises:
        ValueError: ``w`` not 2-D with K a multiple of 256.
    """
    x = _superblocks(w, 32)  # [n, nb, 8, 32]
    n, nb = x.shape[:2]
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / np.float32(31)
    d = (scale.max(-1) / np.float32(63)).astype(np.float16)
    dmin = ((-lo).max(-1) / np.float32(63)).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    ds = d.astype(np.float32)[..., None] * sc.astype(np.float32)
    dm = dmin.astype(np.float32)[..., None] * mn.astype(np.float32)
    q = np.clip(np.rint(_safe_div(x + dm[..., None], ds[..., None])), 0, 31).astype(np.uint8)  # [n, nb, 8, 32]
    nib = (q & 0x0F).reshape(n, nb, 4, 2, 32)  # value e = 64 c + 32 s + i: nibble s of qs[32 c + i]
    qs = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).reshape(n, nb, 128)
    qh = np.zeros((n, nb, 32), np.uint8)
    for b in range(8):  # value e: bit e // 32 of qh[e % 32]
        qh |= (q[:, :, b] >> 4) << b
    out = np.concatenate([d.reshape(n, nb, 1).view(np.uint8), dmin.reshape(n, nb, 1).view(np.uint8),
                          _pack_k_scales(sc, mn), qh, qs], axis=-1)
    return np.ascontiguousarray(out.astype(np.uint8)).reshape(n, -1)
