"""Weights -> the packed layouts of ``kvserve/kernels/csrc/qgemm.c`` (described at the top of that file).

``PackedWeight.data`` is ``uint8 [ceil(N / 16), K / 32, block_bytes]``: output features in groups of 16 (the last
group padded with zero weights, zero scales), each group's 32-value blocks contiguous. Q4 blocks (320 bytes):
float16 ``d[16]``, float16 ``m[16]``, 256 bytes of nibbles; Q8 blocks (544 bytes): float16 ``d[16]``, 512 int8; Q6
blocks (448 bytes, GGUF Q6_K's values): float16 ``d[16]``, int8 sub-block scales ``sc_lo[16]``, ``sc_hi[16]``, 256
bytes of low nibbles, 128 bytes of high 2-bit fields (7 bits a weight, the file's 6.56); Q5F blocks (448 bytes,
GGUF Q5_K's values): a Q4F block then 64 bytes of fifth bits (7 bits a weight, the file's 5.5); Q4K (GGUF Q4_K's
stored parts, 296 bytes a block on average: 4.625 bits a weight, the file's 4.5): per group and super-block of 8 blocks
(256 inputs) float16 ``d[16]``, ``dmin[16]``, then 8 blocks of uint8 ``sc[16]``, ``mn[16]`` (6-bit) and 256 bytes of
nibbles as Q4's; the kernels form ``d * sc`` and ``-(dmin * mn)`` per block (exact in float32: the Q4F values). The
packed bytes per weight equal the GGUF file's for Q4_1 (5 bits) and Q8_0 (8.5 bits); Q4_0 takes 5 bits instead of
4.5 (the stored ``m = -8 d``). Interleaving several outputs' consecutive inputs into one vector follows llama.cpp's
``ggml-cpu`` repacked formats (``block_q4_0x8``); the block contents follow the GGUF spec (``formats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvserve.quant import layouts as L
from kvserve.quant.formats import MXFP4_VALUES, q2_k_values, q4_k_values
from kvserve.quant.layouts import G, Q2K_BLOCK, Q3K_BLOCK, Q4K_BLOCK, QK

# Names kept for callers: block bytes and format ids (the records are ``layouts.LAYOUTS``).
Q4_BLOCK, Q8_BLOCK, Q4F_BLOCK, Q6_BLOCK, Q5F_BLOCK, MX4_BLOCK = (L.Q4.block_bytes, L.Q8.block_bytes, L.Q4F.block_bytes,
                                                                 L.Q6.block_bytes, L.Q5F.block_bytes, L.MX4.block_bytes)
Q4K_SUPER, Q2K_SUPER = L.Q4K.super_bytes, L.Q2K.super_bytes  # a super-block (8 blocks and their d, dmin)
FMT_Q4, FMT_Q8, FMT_Q4F, FMT_Q6, FMT_Q5F, FMT_Q4K, FMT_MX4, FMT_Q2K, FMT_Q3K = (
    L.Q4.fmt, L.Q8.fmt, L.Q4F.fmt, L.Q6.fmt, L.Q5F.fmt, L.Q4K.fmt, L.MX4.fmt, L.Q2K.fmt, L.Q3K.fmt)
#: Twice the E2M1 values of the 16 MXFP4 codes (``formats.MXFP4_VALUES``).
MX4_KVALUES = MXFP4_VALUES
#: MX4 exponents whose 2^(e - 128) is a float16 value (the kernel expands MX4 blocks to Q8 blocks' float16 d).
MX4_E_RANGE = (104, 143)


@dataclass
class PackedWeight:
    """A weight in qgemm.c's layout.

    Attributes:
        fmt: ``FMT_Q4`` (``w = d * q + m``, q in 0..15, float16 d, m), ``FMT_Q4F`` (the same with float32 d, m:
            Q4_K), ``FMT_Q8`` (``w = d * q``, q int8) or ``FMT_Q6`` (``w = (d * sc) * (q - 32)``, q in 0..63, int8
            sc per 16 inputs, float16 d per 256: Q6_K) or ``FMT_Q5F`` (``w = d * q + m``, q in 0..31, float32 d, m:
            Q5_K) or ``FMT_Q4K`` (Q4_K as stored: ``w = (d * sc) * q - (dmin * mn)``, 6-bit sc, mn per 32 inputs,
            float16 d, dmin per 256) or ``FMT_MX4`` (``pack_mx4``) or ``FMT_Q2K`` (Q2_K as stored: ``w = (d * sc) * q
            - dmin * mn``, q in 0..3, 4-bit sc, mn per 16 inputs, float16 d, dmin per 256) or ``FMT_Q3K`` (Q3_K:
            ``pack_q3k``).
        data: ``uint8 [ceil(N / 16), K / 32, 320, 384, 448 or 544]`` torch tensor, contiguous; ``FMT_Q4K``:
            ``uint8 [ceil(N / 16), K / 256, 2368]`` (a super-block's 64 bytes of d, dmin and its 8 blocks); ``FMT_Q2K``:
            ``uint8 [ceil(N / 16), K / 256, 1344]`` (the same with 8 blocks of 160 bytes); ``FMT_Q3K``: ``uint8
            [ceil(N / 16), K / 256, 1824]`` (d[16], 8 blocks of 224 bytes).
        out_features, in_features: ``N``, ``K`` (``K`` a multiple of 32).
        oscale: ``None`` or float32 ``[ceil(N / 16) * 16]``: a per-output factor applied after the sum
            (per-channel int8).
    """

    fmt: int
    data: torch.Tensor
    out_features: int
    in_features: int
    oscale: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        """Bytes the kernel reads per call (weights, scales, ``oscale``)."""
        return self.data.numel() + (0 if self.oscale is None else self.oscale.numel() * 4)


def _pad_rows(a: np.ndarray, n_pad: int) -> np.ndarray:
    if a.shape[0] == n_pad:
        return a
    return np.concatenate([a, np.zeros((n_pad - a.shape[0], *a.shape[1:]), a.dtype)])


def _scales(s: np.ndarray, groups: int, nb: int) -> np.ndarray:
    """float16 (float32) ``[N_pad, nb]`` -> bytes ``[groups, nb, 32 (64)]``."""
    dt = "<f4" if s.dtype == np.float32 else "<f2"
    return np.ascontiguousarray(s.astype(dt).reshape(groups, G, nb).transpose(0, 2, 1)).view(np.uint8)


def pack_q4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> PackedWeight:
    """``q uint8 [N, K]`` (0..15), ``d, m [N, K/32]`` (``w = d * q + m``) -> ``PackedWeight``: ``FMT_Q4`` for
    float16 ``d, m``, ``FMT_Q4F`` for float32 ones (both must have the same dtype)."""
    data, n, k = _pack_nibbles(q, d, m)
    fmt = FMT_Q4F if d.dtype == np.float32 else FMT_Q4
    return PackedWeight(fmt, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def pack_q5(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> PackedWeight:
    """GGUF Q5_K's values -> ``PackedWeight`` (FMT_Q5F): ``q uint8 [N, K]`` (0..31), float32 ``d, m [N, K/32]``
    (``w = d * q + m``): ``pack_q4``'s block of the low 4 bits, then the fifth bits, of step ``j`` (inputs
    ``4j + i`` and ``16 + 4j + i``) at bits ``2j`` and ``2j + 1`` of byte ``o * 4 + i``."""
    data, n, k = _pack_nibbles(q, np.asarray(d, np.float32), np.asarray(m, np.float32))
    groups, nb = data.shape[:2]
    data = np.concatenate([data, _bit_plane(_pad_rows(q, groups * G) >> 4, groups, nb)], axis=-1)
    return PackedWeight(FMT_Q5F, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def _bit_plane(h: np.ndarray, groups: int, nb: int) -> np.ndarray:
    """1-bit values ``h uint8 [groups * 16, K]`` -> ``uint8 [groups, nb, 64]``: of step ``j``, input ``4j + i`` at bit
    ``2j`` and input ``16 + 4j + i`` at bit ``2j + 1`` of byte ``o * 4 + i`` (Q5F's fifth bits, Q3K's third)."""
    h = (h & 1).reshape(groups, G, nb, 2, 4, 4)  # [g, o, b, half, j, i]
    bits = sum(h[:, :, :, half, j].astype(np.uint8) << (2 * j + half) for j in range(4) for half in range(2))
    return bits.transpose(0, 2, 1, 3).reshape(groups, nb, 64).astype(np.uint8)  # [g, b, o, i]


def pack_q4k(q: np.ndarray, scmn: np.ndarray, ddmin: np.ndarray) -> PackedWeight:
    """GGUF Q4_K's stored parts (``formats.decode_q4_k_parts``) -> ``PackedWeight`` (FMT_Q4K): ``q uint8 [N, K]``
    (0..15), ``scmn uint8 [N, K/32, 2]`` (6-bit scale, min), ``ddmin float16 [N, K/256, 2]`` (super-block d, dmin);
    K a multiple of 256. Per group and super-block: ``d[16]``, ``dmin[16]`` (float16), then per block ``sc[16]``,
    ``mn[16]`` and the nibbles as ``pack_q4``'s (4.625 bits a weight)."""
    n, k = q.shape
    nb, groups, ns = k // QK, -(-n // G), k // 256
    q, scmn, ddmin = (_pad_rows(np.asarray(a), groups * G) for a in (q, scmn, ddmin))
    q6 = q.reshape(groups, G, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)  # [g, b, j, o, i, half]
    nib = ((q6[..., 0] & 0x0F) | ((q6[..., 1] & 0x0F) << 4)).reshape(groups, ns, 8, 256).astype(np.uint8)
    sm = scmn.reshape(groups, G, ns, 8, 2).transpose(0, 2, 3, 4, 1).reshape(groups, ns, 8, 32).astype(np.uint8)
    blocks = np.concatenate([sm, nib], axis=-1).reshape(groups, ns, 8 * Q4K_BLOCK)
    head = ddmin.astype("<f2").reshape(groups, G, ns, 2).transpose(0, 2, 3, 1).reshape(groups, ns, 2 * G)
    data = np.concatenate([np.ascontiguousarray(head).view(np.uint8), blocks], axis=-1)
    return PackedWeight(FMT_Q4K, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def _pack_nibbles(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple:
    """The Q4 / Q4F block bytes ``uint8 [groups, nb, 320 or 384]`` of the low 4 bits of ``q``, and ``N``, ``K``."""
    n, k = q.shape
    nb, groups = k // QK, -(-n // G)
    q, d, m = (_pad_rows(a, groups * G) for a in (q, d, m))
    # [g, o, b, half, j, i] -> [g, b, j, o, i, half]: byte j*64 + o*4 + i, low nibble half 0, high nibble half 1
    q6 = q.reshape(groups, G, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
    nib = (q6[..., 0] & 0x0F) | ((q6[..., 1] & 0x0F) << 4)
    data = np.concatenate([_scales(d, groups, nb), _scales(m, groups, nb),
                           nib.reshape(groups, nb, 256).astype(np.uint8)], axis=-1)
    return data, n, k


def pack_mx4(codes: np.ndarray, e: np.ndarray) -> PackedWeight:
    """MXFP4 weights -> ``PackedWeight`` (FMT_MX4, 4.25 bits a weight as the file): ``codes uint8 [N, K]`` (0..15,
    E2M1 codes: ``w = MX4_KVALUES[code] * 2^(e - 128)``), ``e uint8 [N, K/32]`` (E8M0 block exponents). Per block:
    ``e[16]`` then the codes as ``pack_q4``'s nibbles.

    Raises:
        ValueError: a block with a non-zero value whose exponent is outside ``MX4_E_RANGE`` (``2^(e - 128)`` not a
            float16 value, which the kernels need); an all-zero block's exponent is stored as 128 (same values).
    """
    codes, e = np.asarray(codes, np.uint8), np.asarray(e, np.uint8).copy()
    n, k = codes.shape
    zero = (MX4_KVALUES[codes & 0x0F] == 0).reshape(n, k // QK, QK).all(axis=-1)
    e[zero] = 128
    bad = (e < MX4_E_RANGE[0]) | (e > MX4_E_RANGE[1])
    if bad.any():
        raise ValueError(f"MXFP4 block exponent {int(e[bad][0])} (scale 2^{int(e[bad][0]) - 128}) outside the "
                         f"kernels' range {MX4_E_RANGE[0]}..{MX4_E_RANGE[1]} (2^-24..2^15)")
    nb, groups = k // QK, -(-n // G)
    codes, e = _pad_rows(codes, groups * G), _pad_rows(e, groups * G)
    e[n:] = 128
    q6 = codes.reshape(groups, G, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)  # [g, b, j, o, i, half]
    nib = ((q6[..., 0] & 0x0F) | ((q6[..., 1] & 0x0F) << 4)).reshape(groups, nb, 256).astype(np.uint8)
    data = np.concatenate([np.ascontiguousarray(e.reshape(groups, G, nb).transpose(0, 2, 1)), nib], axis=-1)
    return PackedWeight(FMT_MX4, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def pack_q8(q: np.ndarray, d: np.ndarray, oscale: Optional[np.ndarray] = None) -> PackedWeight:
    """``q int8 [N, K]``, ``d float16 [N, K/32]`` (``w = d * q``, times ``oscale[N]`` float32 if given) ->
    ``PackedWeight`` (FMT_Q8)."""
    n, k = q.shape
    nb, groups = k // QK, -(-n // G)
    q, d = _pad_rows(q, groups * G), _pad_rows(d, groups * G)
    # [g, o, b, j, i] -> [g, b, j, o, i]: byte j*64 + o*4 + i
    qq = q.reshape(groups, G, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 512).view(np.uint8)
    data = np.concatenate([_scales(d, groups, nb), qq], axis=-1)
    os_t = None
    if oscale is not None:
        os_t = torch.from_numpy(_pad_rows(np.asarray(oscale, np.float32), groups * G).copy())
    return PackedWeight(FMT_Q8, torch.from_numpy(np.ascontiguousarray(data)), n, k, os_t)


def pack_q6(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> PackedWeight:
    """GGUF Q6_K's values -> ``PackedWeight`` (FMT_Q6): ``q uint8 [N, K]`` (0..63), ``sc int8 [N, K/16]`` (one
    scale per 16 inputs), ``d float16 [N, K/256]`` (one per 256), ``w = (d * sc) * (q - 32)``; K a multiple of 256.
    Layout at the top of ``qgemm.c``: per 32-input block, each output's ``d`` (repeated), its two sub-block scales,
    the low nibbles as ``pack_q4``'s and the high 2 bits, of step ``j`` (inputs ``4j + i`` and ``16 + 4j + i``) at bits
    ``4 (j & 1)`` and ``4 (j & 1) + 2`` of byte ``(j >> 1) * 64 + o * 4 + i``."""
    n, k = q.shape
    nb, groups = k // QK, -(-n // G)
    q, sc, d = (_pad_rows(np.asarray(a), groups * G) for a in (q, sc, d))
    q6 = q.reshape(groups, G, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)  # [g, b, j, o, i, half]
    nib = (q6[..., 0] & 0x0F) | ((q6[..., 1] & 0x0F) << 4)
    sc2 = sc.astype(np.int8).reshape(groups, G, nb, 2).transpose(0, 2, 3, 1)  # [g, b, half, o]
    data = np.concatenate([_scales(np.repeat(d.astype(np.float16), 8, axis=1), groups, nb),
                           sc2.reshape(groups, nb, 2 * G).view(np.uint8), nib.reshape(groups, nb, 256).astype(np.uint8),
                           _two_bit_fields(q >> 4, groups, nb)], axis=-1)
    return PackedWeight(FMT_Q6, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def _two_bit_fields(h: np.ndarray, groups: int, nb: int) -> np.ndarray:
    """2-bit values ``h uint8 [groups * 16, K]`` (0..3) -> ``uint8 [groups, nb, 128]``: of step ``j`` (inputs ``4j + i``
    and ``16 + 4j + i``), bits ``4 (j & 1)`` and ``4 (j & 1) + 2`` of byte ``(j >> 1) * 64 + o * 4 + i`` (Q6's high
    fields, Q2K's values)."""
    h = h.reshape(groups, G, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3).reshape(groups, nb, 2, 2, G, 4, 2)
    # [g, b, j >> 1, j & 1, o, i, half]
    hb = h[:, :, :, 0, ..., 0] | h[:, :, :, 0, ..., 1] << 2 | h[:, :, :, 1, ..., 0] << 4 | h[:, :, :, 1, ..., 1] << 6
    return hb.reshape(groups, nb, 128).astype(np.uint8)


def pack_q2k(q: np.ndarray, scmn: np.ndarray, ddmin: np.ndarray) -> PackedWeight:
    """GGUF Q2_K's stored parts (``formats.decode_q2_k_parts``) -> ``PackedWeight`` (FMT_Q2K, 2.625 bits a weight as
    the file): ``q uint8 [N, K]`` (0..3), ``scmn uint8 [N, K/16]`` (``sc | mn << 4`` per 16 inputs), ``ddmin float16
    [N, K/256, 2]`` (super-block d, dmin); K a multiple of 256; ``w = (d * sc) * q - dmin * mn``. Per group and
    super-block: ``d[16]``, ``dmin[16]`` (float16), then per block ``scmn[2][16]`` (half, output) and the values as
    ``_two_bit_fields``."""
    n, k = q.shape
    nb, groups, ns = k // QK, -(-n // G), k // 256
    q, scmn, ddmin = (_pad_rows(np.asarray(a), groups * G) for a in (q, scmn, ddmin))
    sm = np.asarray(scmn, np.uint8).reshape(groups, G, nb, 2).transpose(0, 2, 3, 1).reshape(groups, nb, 2 * G)
    blocks = np.concatenate([sm, _two_bit_fields(q, groups, nb)], axis=-1).reshape(groups, ns, 8 * Q2K_BLOCK)
    head = ddmin.astype("<f2").reshape(groups, G, ns, 2).transpose(0, 2, 3, 1).reshape(groups, ns, 2 * G)
    data = np.concatenate([np.ascontiguousarray(head).view(np.uint8), blocks], axis=-1)
    return PackedWeight(FMT_Q2K, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def quantize_int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[N, K]`` -> ``(q int8 [N, K], scale float32 [N])``, symmetric per output channel:
    ``scale = max|w_row| / 127`` (1 for an all-zero row), ``q = rint(w / scale)`` in -127..127;
    the dequantized weight is ``q * scale``."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def quantize_q8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[N, K]`` (K a multiple of 32) -> ``(q int8 [N, K], d float16 [N, K/32])`` per 32-block, as
    llama.cpp's ``quantize_row_q8_0`` (``d = max|w| / 127`` rounded to float16, ``q = rint(w / d)``)."""
    n, k = w.shape
    b = np.asarray(w, np.float32).reshape(n, k // QK, QK)
    d16 = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float16)
    d = d16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(b / d[..., None]), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(n, k), d16


# ---- unpacking: rows of the weight a PackedWeight represents, in float32 as gguf dequantizes (one per layout) ----

def _sel(w: PackedWeight, rows: np.ndarray) -> tuple:
    """``(data uint8 [groups, nb (Q4K: nb / 8), bytes], g [T], o [T], groups, nb)`` of ``rows``: row r is output
    ``r % 16`` of group ``r // 16``."""
    data = w.data.numpy()
    return data, rows // G, rows % G, data.shape[0], w.in_features // QK


def _block_scales(data, lay: L.Layout, part: str, dtype: str, g, o, groups: int, nb: int) -> np.ndarray:
    """``[T, nb]`` float32: each row's per-block value of ``part`` (16 values of ``dtype`` per block)."""
    a = lay.off(part)
    return data[..., a:a + G * np.dtype(dtype).itemsize].view(dtype).reshape(groups, nb, G)[g, :, o].astype(np.float32)


def _nibbles(data, off: int, g, o, groups: int, nb: int) -> np.ndarray:
    """``[T, nb, half, j, i]`` uint8: the 4-bit fields of a block's 256 bytes at ``off`` (input
    ``16 half + 4j + i``)."""
    nib = data[..., off:off + 256].reshape(groups, nb, 4, G, 4)[g, :, :, o, :]  # [T, nb, j, i]
    return np.stack([nib & 0x0F, nib >> 4], axis=2)


def unpack_rows_q8(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Q8: ``d * q`` (times ``oscale[row]``), float32 ``[T, K]``."""
    data, g, o, groups, nb = _sel(w, rows)
    q = data[..., L.Q8.off("QS"):].view(np.int8).reshape(groups, nb, 8, G, 4)[g, :, :, o, :]  # [T, nb, j, i]
    d = _block_scales(data, L.Q8, "D", "<f2", g, o, groups, nb)
    full = q.reshape(len(rows), nb, QK).astype(np.float32) * d[..., None]
    if w.oscale is not None:
        full = full * w.oscale.numpy()[rows][:, None, None]
    return full.reshape(len(rows), nb * QK)


def unpack_rows_q6(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Q6: ``(d * sc) * (q - 32)`` per 16 inputs, float32 ``[T, K]``."""
    data, g, o, groups, nb = _sel(w, rows)
    lay, t = L.Q6, len(rows)
    a = lay.off("SC_LO")
    sc = data[..., a:a + 2 * G].view(np.int8).reshape(groups, nb, 2, G)[g, :, :, o].astype(np.float32)  # [T, nb, 2]
    nib = _nibbles(data, lay.off("QL"), g, o, groups, nb)  # [T, nb, half, j, i]
    a = lay.off("QH")
    hb = data[..., a:a + 128].reshape(groups, nb, 2, G, 4)[g, :, :, o, :]  # [T, nb, j >> 1, i]
    hb = np.stack([hb[:, :, 0], hb[:, :, 0] >> 4, hb[:, :, 1], hb[:, :, 1] >> 4], axis=2)  # [T, nb, j, i]
    q = nib | (np.stack([hb & 3, (hb >> 2) & 3], axis=2) << 4)
    q = q.reshape(t, nb, 2, 16).astype(np.float32) - np.float32(32)  # [T, nb, half, 16]
    full = (_block_scales(data, lay, "D", "<f2", g, o, groups, nb)[..., None] * sc)[..., None] * q
    return full.reshape(t, nb * QK)


def pack_q3k(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> PackedWeight:
    """GGUF Q3_K's values in ``formats.decode_q3_k``'s form -> ``PackedWeight`` (FMT_Q3K, 3.5625 bits a weight against
    the file's 3.4375): ``q uint8 [N, K]`` in 28..35 (``q - 32`` the 3-bit value), ``sc int8 [N, K/16]``, ``d float16
    [N, K/256]``; ``w = (d * sc) * (q - 32)``; K a multiple of 256. Per group and super-block: ``d[16]``, then per
    block ``sc[2][16]`` (half, output), the low 2 bits of ``q - 28`` as ``_two_bit_fields`` and its third bit as
    ``_bit_plane``."""
    n, k = q.shape
    nb, groups, ns = k // QK, -(-n // G), k // 256
    q, sc, d = (_pad_rows(np.asarray(a), groups * G) for a in (q, sc, d))
    u = (q.astype(np.int16) - 28).clip(0, 7).astype(np.uint8)  # 0..7 (padded rows: 0, with zero scales)
    s2 = np.asarray(sc, np.int8).reshape(groups, G, nb, 2).transpose(0, 2, 3, 1).reshape(groups, nb, 2 * G)
    blocks = np.concatenate([s2.view(np.uint8), _two_bit_fields(u & 3, groups, nb), _bit_plane(u >> 2, groups, nb)],
                            axis=-1).reshape(groups, ns, 8 * Q3K_BLOCK)
    head = np.ascontiguousarray(np.asarray(d).astype("<f2").reshape(groups, G, ns).transpose(0, 2, 1)).view(np.uint8)
    data = np.concatenate([head, blocks], axis=-1)
    return PackedWeight(FMT_Q3K, torch.from_numpy(np.ascontiguousarray(data)), n, k)


def unpack_rows_q3k(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Q3K: ``(d * sc) * (q - 4)`` per 16 inputs, q in 0..7 (``formats.dequantize``'s Q3_K products), float32
    ``[T, K]``."""
    data, g, o, groups, nb = _sel(w, rows)
    lay, t = L.Q3K, len(rows)
    d = data[..., :lay.super_offsets["BLOCKS"]].view("<f2").reshape(groups, nb // 8, G)[g, :, o]  # [T, nb / 8]
    blk = data[..., lay.super_offsets["BLOCKS"]:].reshape(groups, nb, Q3K_BLOCK)
    a = lay.off("SC")
    sc = blk[..., a:a + 2 * G].view(np.int8).reshape(groups, nb, 2, G)[g, :, :, o].astype(np.float32)  # [T, nb, 2]
    a = lay.off("QS")
    hb = blk[..., a:a + 128].reshape(groups, nb, 2, G, 4)[g, :, :, o, :]  # [T, nb, j >> 1, i]
    hb = np.stack([hb[:, :, 0], hb[:, :, 0] >> 4, hb[:, :, 1], hb[:, :, 1] >> 4], axis=2)  # [T, nb, j, i]
    a = lay.off("QH")
    h3 = blk[..., a:a + 64].reshape(groups, nb, G, 4)[g, :, o, :][:, :, None, None, :]  # [T, nb, 1, 1, i]
    shift = (2 * np.arange(4)[None, :] + np.arange(2)[:, None]).astype(np.uint8)[:, :, None]  # [half, j, 1]
    u = np.stack([hb & 3, (hb >> 2) & 3], axis=2) | (((h3 >> shift) & 1) << 2)  # [T, nb, half, j, i]
    q3 = (u.astype(np.int8) - np.int8(4)).astype(np.float32).reshape(t, nb, 2, 16)
    ds = np.repeat(d.astype(np.float32), 8, axis=1)[..., None] * sc  # [T, nb, 2]
    return (ds[..., None] * q3).reshape(t, nb * QK)


def unpack_rows_q2k(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Q2K: ``(d * sc) * q - dmin * mn`` per 16 inputs (``formats.q2_k_values``), float32 ``[T, K]``."""
    data, g, o, groups, nb = _sel(w, rows)
    lay, t = L.Q2K, len(rows)
    ddmin = data[..., :lay.super_offsets["BLOCKS"]].view("<f2").reshape(groups, nb // 8, 2, G)[g, :, :, o]
    blk = data[..., lay.super_offsets["BLOCKS"]:].reshape(groups, nb, Q2K_BLOCK)
    a = lay.off("SCMN")
    scmn = blk[..., a:a + 2 * G].reshape(groups, nb, 2, G)[g, :, :, o].reshape(t, 2 * nb)  # [T, K/16]
    a = lay.off("QS")
    hb = blk[..., a:a + 128].reshape(groups, nb, 2, G, 4)[g, :, :, o, :]  # [T, nb, j >> 1, i]
    hb = np.stack([hb[:, :, 0], hb[:, :, 0] >> 4, hb[:, :, 1], hb[:, :, 1] >> 4], axis=2)  # [T, nb, j, i]
    q = np.stack([hb & 3, (hb >> 2) & 3], axis=2).reshape(t, nb * QK)  # [T, nb, half, j, i]
    return q2_k_values(q, scmn, ddmin)


def unpack_rows_q4(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Q4, Q4F, Q5F, Q4K: ``d * q + m`` per block (Q4K: ``d = d_sb * sc``, ``m = -(dmin_sb * mn)``), float32
    ``[T, K]``."""
    data, g, o, groups, nb = _sel(w, rows)
    lay, t = L.LAYOUTS[w.fmt], len(rows)
    if w.fmt == FMT_Q4K:  # [groups, nb / 8, super-block]: d[16], dmin[16] float16, then 8 blocks
        ddmin = data[..., :lay.super_offsets["BLOCKS"]].view("<f2").reshape(groups, nb // 8, 2, G)[g, :, :, o]
        blk = data[..., lay.super_offsets["BLOCKS"]:].reshape(groups, nb, Q4K_BLOCK)
        a = lay.off("SC")
        d, m = q4_k_values(blk[..., a:a + 2 * G].reshape(groups, nb, 2, G)[g, :, :, o], ddmin)
        q = _nibbles(blk, lay.off("QS"), g, o, groups, nb)
    else:
        dt = "<f2" if w.fmt == FMT_Q4 else "<f4"
        d, m = (_block_scales(data, lay, part, dt, g, o, groups, nb) for part in ("D", "M"))
        q = _nibbles(data, lay.off("QS"), g, o, groups, nb)
    if w.fmt == FMT_Q5F:  # the fifth bit of (half, j) at bit 2j + half of byte o * 4 + i
        a = lay.off("QH")
        hb = data[..., a:a + 64].reshape(groups, nb, G, 4)[g, :, o, :][:, :, None, None, :]  # [T, nb, 1, 1, i]
        shift = (2 * np.arange(4)[None, :] + np.arange(2)[:, None]).astype(np.uint8)[:, :, None]  # [half, j, 1]
        q = q | (((hb >> shift) & 1) << 4)
    return (d[..., None] * q.reshape(t, nb, QK).astype(np.float32) + m[..., None]).reshape(t, nb * QK)


def unpack_rows_mx4(w: PackedWeight, rows: np.ndarray) -> np.ndarray:
    """MX4: ``MX4_KVALUES[code] * 2^(e - 128)``, float32 ``[T, K]`` (gguf's MXFP4 dequantize)."""
    data, g, o, groups, nb = _sel(w, rows)
    e = data[..., L.MX4.off("E"):L.MX4.off("E") + G].reshape(groups, nb, G)[g, :, o].astype(np.int32)  # [T, nb]
    d = np.ldexp(np.float32(1), e - 128).astype(np.float32)
    q = MX4_KVALUES[_nibbles(data, L.MX4.off("QS"), g, o, groups, nb)].reshape(len(rows), nb, QK)
    return (d[..., None] * q.astype(np.float32)).reshape(len(rows), nb * QK)
