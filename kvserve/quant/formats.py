"""GGUF block formats decoded in numpy: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4.

Layouts from the GGUF spec / llama.cpp ``ggml-common.h`` (``block_q4_0`` ...) and the arithmetic of
``ggml-quants.c`` ``dequantize_row_*``, done in float32 in the same order, so ``dequantize`` equals
``gguf.quants.dequantize`` bit for bit (``tests/model/test_quant_formats.py``). A tensor's bytes are rows of blocks:
``raw`` is ``uint8 [N, bytes_per_row]`` (what ``gguf.GGUFReader`` gives for a 2-D tensor), ``K`` = elements per row.

Block layouts (``d``, ``dmin``, ``m`` are little-endian float16; ``QK_K = 256``):

- Q4_0 (32 values, 18 bytes): ``d``, ``qs[16]``; byte ``j`` holds value ``j`` (low nibble) and ``j + 16`` (high);
  ``w = d * (q - 8)``.
- Q4_1 (32 values, 20 bytes): ``d``, ``m``, ``qs[16]`` as Q4_0; ``w = d * q + m``.
- Q5_0 (32 values, 22 bytes): ``d``, ``qh`` (a little-endian uint32: bit ``j`` is bit 4 of value ``j``), ``qs[16]``
  as Q4_0; ``w = d * (q - 16)``. Q5_1 (24 bytes): ``d``, ``m``, ``qh``, ``qs[16]``; ``w = d * q + m``.
- Q8_0 (32 values, 34 bytes): ``d``, ``qs[32]`` int8; ``w = d * q``.
- IQ4_NL (32 values, 18 bytes): ``d``, ``qs[16]`` as Q4_0, each nibble an index into the 16 int8 values of
  ``IQ4_NL_VALUES``; ``w = d * IQ4_NL_VALUES[q]``.
- Q4_K (256 values, 144 bytes): ``d``, ``dmin``, ``scales[12]`` (eight 6-bit scales and mins), ``qs[128]``;
  value ``e = 64c + 32s + i`` is nibble ``s`` of byte ``32c + i``; ``w = (d * sc[e // 32]) * q - dmin * mn[e // 32]``.
- Q5_K (256 values, 176 bytes): ``d``, ``dmin``, ``scales[12]``, ``qh[32]``, ``qs[128]``; the low 4 bits as Q4_K,
  bit 4 is bit ``e // 32`` of ``qh[e % 32]``; same formula.
- Q6_K (256 values, 210 bytes): ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d``; with ``e = 128h + r``: low 4 bits
  are nibble ``r // 64`` of ``ql[64h + r % 64]``, high 2 bits are bits ``2 (r // 32)`` of ``qh[32h + r % 32]``;
  ``w = (d * sc[e // 16]) * (q - 32)``.
- Q2_K (256 values, 84 bytes): ``scales[16]`` (byte ``s``: the 4-bit scale ``sc`` of values ``16s..16s + 15`` in its
  low nibble, the 4-bit min ``mn`` in its high), ``qs[64]``, ``d``, ``dmin``; value ``e = 128h + 32s + l`` is bits
  ``2s`` of ``qs[32h + l]``; ``w = (d * sc[e // 16]) * q - dmin * mn[e // 16]``.
- Q3_K (256 values, 110 bytes): ``hmask[32]``, ``qs[64]``, ``scales[12]`` (sixteen 6-bit scales ``s``), ``d``; value
  ``e = 128h + 32s + l``: 2 low bits at bit ``2s`` of ``qs[32h + l]``, high-mask bit ``e // 32`` of ``hmask[l]``;
  ``w = (d * (s[e // 16] - 32)) * (low - (bit ? 0 : 4))``.
- MXFP4 (32 values, 17 bytes; OCP Microscaling v1.0): ``e`` (E8M0), ``qs[16]`` as Q4_0's, 4-bit E2M1 codes;
  ``w = MXFP4_VALUES[code] * 2^(e - 128)`` (twice the E2M1 value times half the block scale ``2^(e - 127)``).
"""

from __future__ import annotations

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
Q5_0, Q5_1, IQ4_NL = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.IQ4_NL
F16, BF16 = GGMLQuantizationType.F16, GGMLQuantizationType.BF16
Q3_K, MXFP4 = GGMLQuantizationType.Q3_K, GGMLQuantizationType.MXFP4
Q2_K = GGMLQuantizationType.Q2_K
#: 16-bit float weights, kept in 16 bits (``kvserve.layers.linear.linear_16bit``).
FLOAT16_TYPES = (F16, BF16)
#: The formats kvserve keeps in their own bits (block formats, and 2-D F16 / BF16 weights).
QUANTIZED_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, F16, BF16)
#: IQ4_NL's non-linear 4-bit grid (llama.cpp ``kvalues_iq4nl``, ``ggml-common.h``).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
#: Twice the E2M1 values of the 16 MXFP4 codes (OCP MX v1.0; llama.cpp ``kvalues_mxfp4``): ``w = value * 2^(e - 128)``.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def block_size(qtype) -> tuple[int, int]:
    """``(values per block, bytes per block)`` of a GGML type (``gguf.GGML_QUANT_SIZES``)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def _blocks(raw: np.ndarray, qtype, k: int) -> np.ndarray:
    """``raw [N, bytes_per_row]`` uint8 -> ``[N, K / values_per_block, bytes_per_block]`` (a view). ValueError if
    the sizes do not fit."""
    bs, tb = block_size(qtype)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or k % bs or raw.shape[1] != k // bs * tb:
        raise ValueError(f"{GGMLQuantizationType(qtype).name} rows of {k} values need uint8 [N, {k // bs * tb}] "
                         f"(K a multiple of {bs}), got {raw.dtype} {list(raw.shape)}")
    return raw.reshape(raw.shape[0], k // bs, tb)


def _f16(b: np.ndarray) -> np.ndarray:
    """Last axis of 2 bytes -> float16 (little-endian), squeezed."""
    return np.ascontiguousarray(b).view("<f2")[..., 0]


def _nibbles(qs: np.ndarray, byte_of: np.ndarray, shift_of: np.ndarray) -> np.ndarray:
    return (qs[..., byte_of] >> shift_of) & np.uint8(0x0F)


# Index maps: value e of a block -> (byte, shift).
_E32 = np.arange(32)
_Q4_BYTE, _Q4_SHIFT = _E32 % 16, (4 * (_E32 // 16)).astype(np.uint8)
_E256 = np.arange(256)
_QK4_BYTE, _QK4_SHIFT = 32 * (_E256 // 64) + _E256 % 32, (4 * ((_E256 // 32) % 2)).astype(np.uint8)
_QK5_HBYTE, _QK5_HSHIFT = _E256 % 32, (_E256 // 32).astype(np.uint8)
_R = _E256 % 128
_Q6_LBYTE, _Q6_LSHIFT = 64 * (_E256 // 128) + _R % 64, (4 * (_R // 64)).astype(np.uint8)
_Q6_HBYTE, _Q6_HSHIFT = 32 * (_E256 // 128) + _R % 32, (2 * (_R // 32)).astype(np.uint8)


def decode_q4(raw: np.ndarray, qtype, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 or Q4_1 rows -> ``(q uint8 [N, K] in 0..15, d float16 [N, K/32], m float16 [N, K/32])`` with
    ``w = d * q + m`` (Q4_0: ``m = -8 d``, exact in float16 unless ``|d| > 8188``, which raises ValueError)."""
    blk = _blocks(raw, qtype, k)
    d = _f16(blk[..., 0:2])
    if GGMLQuantizationType(qtype) == Q4_0:
        with np.errstate(over="ignore"):
            m = (d * np.float16(-8)).astype(np.float16)
        if not np.isfinite(m[np.isfinite(d)]).all():
            raise ValueError("Q4_0 scale too large for -8 * d in float16")
        qs = blk[..., 2:18]
    elif GGMLQuantizationType(qtype) == Q4_1:
        m, qs = _f16(blk[..., 2:4]), blk[..., 4:20]
    else:
        raise ValueError(f"decode_q4 takes Q4_0 or Q4_1, got {GGMLQuantizationType(qtype).name}")
    q = _nibbles(qs, _Q4_BYTE, _Q4_SHIFT).reshape(raw.shape[0], k)
    return q, d, m


def decode_q5(raw: np.ndarray, qtype, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0 or Q5_1 rows -> ``(q uint8 [N, K] in 0..31, d float32 [N, K/32], m float32 [N, K/32])`` with
    ``w = d * q + m`` (Q5_0: ``m = -16 d``; every product and sum exact in float32, so equal in value to
    ``dequantize``; a zero weight of a negative ``d`` is +0 here, -0 there)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in (Q5_0, Q5_1):
        raise ValueError(f"decode_q5 takes Q5_0 or Q5_1, got {qtype.name}")
    blk = _blocks(raw, qtype, k)
    d = _f16(blk[..., 0:2]).astype(np.float32)
    o = 2 if qtype == Q5_0 else 4
    m = d * np.float32(-16) if qtype == Q5_0 else _f16(blk[..., 2:4]).astype(np.float32)
    qh = np.ascontiguousarray(blk[..., o:o + 4]).view("<u4")  # [N, nb, 1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)  # [N, nb, 32]
    q = _nibbles(blk[..., o + 4:o + 20], _Q4_BYTE, _Q4_SHIFT) | (hi << np.uint8(4))
    return q.reshape(raw.shape[0], k), d, m


def decode_iq4_nl(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL rows -> ``(q int8 [N, K], d float16 [N, K/32])`` with ``w = d * q``: the grid values themselves, so
    the Q8 kernels compute with the file's values exactly."""
    blk = _blocks(raw, IQ4_NL, k)
    q = IQ4_NL_VALUES[_nibbles(blk[..., 2:18], _Q4_BYTE, _Q4_SHIFT)]
    return q.reshape(raw.shape[0], k), _f16(blk[..., 0:2])


def decode_q4_k(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows -> ``(q uint8 [N, K] in 0..15, d float32 [N, K/32], m float32 [N, K/32])`` with ``w = d * q + m``
    per 32-value sub-block: ``d = d_sb * sc``, ``m = -(dmin_sb * mn)``, both exact in float32, so ``d * q + m``
    equals ``dequantize`` bit for bit."""
    q, scmn, ddmin = decode_q4_k_parts(raw, k)
    return (q, *q4_k_values(scmn, ddmin))


def q4_k_values(scmn: np.ndarray, ddmin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's stored parts (``decode_q4_k_parts``: ``scmn uint8 [N, nb, 2]``, ``ddmin float16 [N, nb / 8, 2]``) ->
    ``(d, m)`` float32 ``[N, nb]`` per 32 values: ``d = d_sb * sc``, ``m = -(dmin_sb * mn)`` (exact in float32)."""
    sb = np.repeat(ddmin.astype(np.float32), 8, axis=-2)  # [N, nb, 2]: each block's super-block d, dmin
    return sb[..., 0] * scmn[..., 0].astype(np.float32), -(sb[..., 1] * scmn[..., 1].astype(np.float32))


def decode_q4_k_parts(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows -> ``(q uint8 [N, K] in 0..15, scmn uint8 [N, K/32, 2], ddmin float16 [N, K/256, 2])``: the
    6-bit sub-block scale and min of each 32 values and the super-block's ``d`` and ``dmin``, as stored (the parts of
    ``decode_q4_k``'s ``d = d_sb * sc``, ``m = -(dmin_sb * mn)``): ``pack.pack_q4k``'s input."""
    blk = _blocks(raw, Q4_K, k)
    n = blk.shape[0]
    sc, mn = _k_scales(blk[..., 4:16])
    scmn = np.stack([sc, mn], axis=-1).reshape(n, k // 32, 2)
    ddmin = np.stack([_f16(blk[..., 0:2]), _f16(blk[..., 2:4])], axis=-1).reshape(n, k // 256, 2)
    q = _nibbles(blk[..., 16:144], _QK4_BYTE, _QK4_SHIFT).reshape(n, k)
    return q, scmn.astype(np.uint8), ddmin


def decode_q8(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> ``(q int8 [N, K], d float16 [N, K/32])`` with ``w = d * q``."""
    blk = _blocks(raw, Q8_0, k)
    return blk[..., 2:].view(np.int8).reshape(raw.shape[0], k), _f16(blk[..., 0:2])


def decode_q5_k(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K rows -> ``(q uint8 [N, K] in 0..31, d float32 [N, K/32], m float32 [N, K/32])`` with ``w = d * q + m``
    per 32-value sub-block, as ``decode_q4_k`` (exact: ``d * q + m`` equals ``dequantize`` bit for bit)."""
    blk = _blocks(raw, Q5_K, k)
    n = blk.shape[0]
    sc, mn = _k_scales(blk[..., 4:16])
    d = _f16(blk[..., 0:2]).astype(np.float32)[..., None] * sc.astype(np.float32)
    m = -(_f16(blk[..., 2:4]).astype(np.float32)[..., None] * mn.astype(np.float32))
    q = _nibbles(blk[..., 48:176], _QK4_BYTE, _QK4_SHIFT)
    q = q | (((blk[..., 16:48][..., _QK5_HBYTE] >> _QK5_HSHIFT) & np.uint8(1)) << np.uint8(4))
    return q.reshape(n, k), d.reshape(n, k // 32), m.reshape(n, k // 32)


def decode_q6_k(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows -> ``(q uint8 [N, K] in 0..63, sc int8 [N, K/16], d float16 [N, K/256])`` with
    ``w = (d * sc) * (q - 32)`` per 16-value sub-block, in float32 as ``dequantize`` (the file's values)."""
    blk = _blocks(raw, Q6_K, k)
    n = blk.shape[0]
    lo = (blk[..., 0:128][..., _Q6_LBYTE] >> _Q6_LSHIFT) & np.uint8(0x0F)
    hi = (blk[..., 128:192][..., _Q6_HBYTE] >> _Q6_HSHIFT) & np.uint8(3)
    q = (lo | (hi << np.uint8(4))).reshape(n, k)
    return q, blk[..., 192:208].view(np.int8).reshape(n, k // 16), _f16(blk[..., 208:210])


def decode_q2_k_parts(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K rows -> ``(q uint8 [N, K] in 0..3, scmn uint8 [N, K/16], ddmin float16 [N, K/256, 2])``: the 2-bit
    values, each 16 values' stored scale byte (``sc`` in the low nibble, ``mn`` in the high) and the super-block's
    ``d`` and ``dmin``, as stored, so ``w = (d * sc) * q - dmin * mn``: ``pack.pack_q2k``'s input."""
    blk = _blocks(raw, Q2_K, k)
    n, nb = blk.shape[:2]
    q = (blk[..., 16:80].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & np.uint8(3)
    ddmin = np.stack([_f16(blk[..., 80:82]), _f16(blk[..., 82:84])], axis=-1)
    return q.reshape(n, k), np.ascontiguousarray(blk[..., 0:16]).reshape(n, k // 16), ddmin


def q2_k_values(q: np.ndarray, scmn: np.ndarray, ddmin: np.ndarray) -> np.ndarray:
    """``decode_q2_k_parts``' parts (``q [N, K]``, ``scmn [N, K/16]``, ``ddmin [N, K/256, 2]``) -> float32 ``[N, K]``:
    ``(d * sc) * q - dmin * mn`` per 16 values, in float32 in ``dequantize``'s order (its bits)."""
    n, k = q.shape
    sb = np.repeat(ddmin.astype(np.float32), 16, axis=-2)  # [N, K/16, 2]: each sub-block's super-block d, dmin
    dl = sb[..., 0] * (scmn & 0x0F).astype(np.float32)
    ml = sb[..., 1] * (scmn >> 4).astype(np.float32)
    return (dl[..., None] * q.reshape(n, k // 16, 16).astype(np.float32) - ml[..., None]).reshape(n, k)


def decode_q3_k(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K rows -> ``decode_q6_k``'s form ``(q uint8 [N, K] in 28..35, sc int8 [N, K/16] in -32..31, d float16
    [N, K/256])`` with ``w = (d * sc) * (q - 32)``: Q3_K's ``(d * (s - 32)) * q3`` with ``q3 = q - 32`` in -4..3
    (2 low bits, minus 4 where the high-mask bit is clear) and ``s`` its 6-bit scale, the same products as
    ``dequantize``, so Q3_K runs on the Q6 tiles exactly (``pack.pack_q3k``: its compact Q3K layout)."""
    blk = _blocks(raw, Q3_K, k)
    n, nb = blk.shape[:2]
    hmask, qs, scales = blk[..., 0:32], blk[..., 32:96], blk[..., 96:108]
    lo = (scales[..., 0:8].reshape(n, nb, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)).reshape(n, nb, 16)
    hi = (scales[..., 8:12].reshape(n, nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)).reshape(n, nb, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)).reshape(n, nb, 256) & 3
    qh = (hmask.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)).reshape(n, nb, 256) & 1
    q = ql + (qh << 2) + np.uint8(28)  # q3 + 32 = ql - 4 (1 - qh) + 32
    return q.reshape(n, k), sc.reshape(n, k // 16), _f16(blk[..., 108:110])


def decode_mxfp4(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 rows (GGUF: per 32 values an E8M0 byte ``e``, then ``qs[16]`` as Q4_0's) -> ``(codes uint8 [N, K] in
    0..15, e uint8 [N, K/32])`` with ``w = MXFP4_VALUES[code] * 2^(e - 128)`` (OCP MX v1.0; gguf's
    ``MXFP4.dequantize_blocks``): ``pack.pack_mx4``'s input."""
    blk = _blocks(raw, MXFP4, k)
    return _nibbles(blk[..., 1:17], _Q4_BYTE, _Q4_SHIFT).reshape(raw.shape[0], k), np.ascontiguousarray(blk[..., 0])


def decode_mxfp4_hf(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Hugging Face MXFP4 weight (gpt-oss's ``*_blocks`` uint8 ``[..., N, K/32, 16]``: byte ``b`` holds value
    ``2b`` in its low nibble and ``2b + 1`` in its high; ``*_scales`` uint8 ``[..., N, K/32]``: E8M0, ``w =
    FP4_VALUES[code] * 2^(scale - 127)``, transformers' ``convert_moe_packed_tensors``) -> ``decode_mxfp4``'s
    ``(codes [..., N, K], e [..., N, K/32])``: the same codes, and ``e = scale`` since ``FP4_VALUES`` are half of
    ``MXFP4_VALUES``.

    Raises:
        ValueError: shapes that do not match.
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., N, K/32, 16] and scales [..., N, K/32] expected, got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., N, K/32, 16, 2]: value 2b, 2b + 1
    return codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32), scales


def _k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K ``scales[12]`` -> eight 6-bit scales and eight 6-bit mins (llama.cpp ``get_scale_min_k4``)."""
    a, b, c = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def dequantize(raw: np.ndarray, qtype, k: int) -> np.ndarray:
    """Rows of any of ``QUANTIZED_TYPES`` -> float32 ``[N, K]``, equal to ``gguf.quants.dequantize``.

    Raises:
        ValueError: an unsupported type, or ``raw`` not ``uint8 [N, bytes_per_row]`` for rows of ``k`` values.
    """
    qtype = GGMLQuantizationType(qtype)
    n = np.asarray(raw).shape[0]
    if qtype == F16:
        return _blocks(raw, qtype, k).view("<f2").astype(np.float32).reshape(n, k)
    if qtype == BF16:
        return (_blocks(raw, qtype, k).view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(n, k)
    if qtype in (Q4_0, Q4_1):
        blk = _blocks(raw, qtype, k)
        d = _f16(blk[..., 0:2]).astype(np.float32)[..., None]
        if qtype == Q4_0:
            q = _nibbles(blk[..., 2:18], _Q4_BYTE, _Q4_SHIFT).astype(np.int8) - np.int8(8)
            return (d * q.astype(np.float32)).reshape(n, k)
        q = _nibbles(blk[..., 4:20], _Q4_BYTE, _Q4_SHIFT).astype(np.float32)
        return (d * q + _f16(blk[..., 2:4]).astype(np.float32)[..., None]).reshape(n, k)
    if qtype in (Q8_0, IQ4_NL):
        q, d = decode_q8(raw, k) if qtype == Q8_0 else decode_iq4_nl(raw, k)
        return (q.reshape(n, -1, 32).astype(np.float32) * d.astype(np.float32)[..., None]).reshape(n, k)
    if qtype in (Q5_0, Q5_1):
        q, d, m = decode_q5(raw, qtype, k)
        q = q.reshape(n, -1, 32)
        if qtype == Q5_0:  # d * (q - 16): the same value as d * q + m, and gguf's sign of a zero
            return (d[..., None] * (q.astype(np.int8) - np.int8(16)).astype(np.float32)).reshape(n, k)
        return (q.astype(np.float32) * d[..., None] + m[..., None]).reshape(n, k)
    if qtype in (Q4_K, Q5_K):
        blk = _blocks(raw, qtype, k)
        d, dmin = _f16(blk[..., 0:2]).astype(np.float32), _f16(blk[..., 2:4]).astype(np.float32)
        sc, mn = _k_scales(blk[..., 4:16])
        if qtype == Q4_K:
            q = _nibbles(blk[..., 16:144], _QK4_BYTE, _QK4_SHIFT)
        else:
            q = _nibbles(blk[..., 48:176], _QK4_BYTE, _QK4_SHIFT)
            q = q | (((blk[..., 16:48][..., _QK5_HBYTE] >> _QK5_HSHIFT) & np.uint8(1)) << np.uint8(4))
        ds = (d[..., None] * sc.astype(np.float32))[..., None]  # [N, nb, 8, 1]
        dm = (dmin[..., None] * mn.astype(np.float32))[..., None]
        w = ds * q.reshape(*q.shape[:-1], 8, 32).astype(np.float32) - dm
        return w.reshape(n, k)
    if qtype == Q2_K:
        return q2_k_values(*decode_q2_k_parts(raw, k))
    if qtype == Q3_K:
        q, sc, d = decode_q3_k(raw, k)
        ds = (d.astype(np.float32)[..., None] * sc.reshape(n, -1, 16).astype(np.float32))[..., None]  # [N, nb, 16, 1]
        q3 = (q.astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, -1, 16, 16)
        return (ds * q3).reshape(n, k)
    if qtype == MXFP4:
        codes, e = decode_mxfp4(raw, k)
        bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
        d = bits.view(np.float32)  # 2^(e - 128), gguf's e8m0_to_fp32_half
        return (d[..., None] * MXFP4_VALUES[codes].reshape(n, -1, 32).astype(np.float32)).reshape(n, k)
    if qtype == Q6_K:
        blk = _blocks(raw, qtype, k)
        lo = (blk[..., 0:128][..., _Q6_LBYTE] >> _Q6_LSHIFT) & np.uint8(0x0F)
        hi = (blk[..., 128:192][..., _Q6_HBYTE] >> _Q6_HSHIFT) & np.uint8(3)
        q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)
        ds = (_f16(blk[..., 208:210]).astype(np.float32)[..., None] * sc)[..., None]  # [N, nb, 16, 1]
        return (ds * q.reshape(*q.shape[:-1], 16, 16).astype(np.float32)).reshape(n, k)
    raise ValueError(f"unsupported GGML type {qtype.name}; supported: {[t.name for t in QUANTIZED_TYPES]}")
