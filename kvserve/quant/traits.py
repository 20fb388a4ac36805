"""The table of weight formats: one record per GGUF type and one per kernel layout (ggml's ``type_traits`` idea).

- ``TYPE_TRAITS[qtype]`` (``TypeTraits``): a GGUF type's block geometry (values and bytes per block, from
  ``gguf.GGML_QUANT_SIZES``), the kernel layout its values run on, the ``kind`` named in layer paths and the load
  log, and ``decode(raw, k) -> parts``: the arrays the layout's ``pack`` takes, every one with a row per output so
  a fused projection's parts concatenate (``concat_parts``).
- ``LAYOUT_TRAITS[fmt]`` (``LayoutTraits``): a kernel layout's geometry (``layouts.Layout``: named byte offsets,
  shared with the C header), ``pack(*parts) -> PackedWeight`` and ``unpack(w, rows) -> float32 rows``.

A new GGUF type is one ``TypeTraits`` line (and a decoder in ``formats``); a new layout is a ``layouts.Layout``
record, its pack / unpack in ``pack``, one ``LayoutTraits`` line, and its kernel in ``csrc/``.

Every type here is kept exactly: the packed layout holds the file's values (docs/quantization.md, "Formats").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.quant import formats as F
from kvserve.quant import layouts as L
from kvserve.quant import pack as P


@dataclass(frozen=True)
class LayoutTraits:
    """A kernel layout: its geometry, and how weights go in and out of it.

    Attributes:
        layout: the ``layouts.Layout`` record (format id, block bytes, named offsets).
        pack: ``(*parts) -> PackedWeight``.
        unpack: ``(PackedWeight, rows int64 [T]) -> float32 [T, K]``: the rows' values, as ``gguf`` dequantizes.
    """

    layout: L.Layout
    pack: Callable
    unpack: Callable


LAYOUT_TRAITS = {t.layout.fmt: t for t in (
    LayoutTraits(L.Q4, lambda q, d, m: P.pack_q4(q, np.asarray(d, np.float16), np.asarray(m, np.float16)),
                 P.unpack_rows_q4),
    LayoutTraits(L.Q4F, lambda q, d, m: P.pack_q4(q, np.asarray(d, np.float32), np.asarray(m, np.float32)),
                 P.unpack_rows_q4),
    LayoutTraits(L.Q5F, P.pack_q5, P.unpack_rows_q4),
    LayoutTraits(L.Q4K, P.pack_q4k, P.unpack_rows_q4),
    LayoutTraits(L.Q8, lambda q, d: P.pack_q8(q, d), P.unpack_rows_q8),
    LayoutTraits(L.Q6, P.pack_q6, P.unpack_rows_q6),
    LayoutTraits(L.MX4, P.pack_mx4, P.unpack_rows_mx4),
    LayoutTraits(L.Q2K, P.pack_q2k, P.unpack_rows_q2k),
    LayoutTraits(L.Q3K, P.pack_q3k, P.unpack_rows_q3k),
)}


@dataclass(frozen=True)
class TypeTraits:
    """A GGUF type kvserve keeps in its own bits.

    Attributes:
        qtype: the ``gguf.GGMLQuantizationType``.
        kind: the name in layer paths (``q4_k/avx512_vnni``) and the load log.
        layout: the ``layouts.Layout`` its values are packed into.
        decode: ``(raw uint8 [N, bytes_per_row], k) -> parts`` for ``LAYOUT_TRAITS[layout.fmt].pack``.
        bits: bits a weight in the packed layout (the file's: ``block_bytes * 8 / block_values``).
    """

    qtype: GGMLQuantizationType
    kind: str
    layout: L.Layout
    decode: Callable
    bits: float

    @property
    def block_values(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


TYPE_TRAITS = {t.qtype: t for t in (
    TypeTraits(F.Q4_0, "q4", L.Q4, lambda raw, k: F.decode_q4(raw, F.Q4_0, k), 5.0),
    TypeTraits(F.Q4_1, "q4", L.Q4, lambda raw, k: F.decode_q4(raw, F.Q4_1, k), 5.0),
    TypeTraits(F.Q5_0, "q5_0", L.Q5F, lambda raw, k: F.decode_q5(raw, F.Q5_0, k), 7.0),
    TypeTraits(F.Q5_1, "q5_1", L.Q5F, lambda raw, k: F.decode_q5(raw, F.Q5_1, k), 7.0),
    TypeTraits(F.Q8_0, "q8", L.Q8, F.decode_q8, 8.5),
    TypeTraits(F.IQ4_NL, "iq4_nl", L.Q8, F.decode_iq4_nl, 8.5),
    TypeTraits(F.Q2_K, "q2_k", L.Q2K, F.decode_q2_k_parts, 2.625),
    TypeTraits(F.Q3_K, "q3_k", L.Q3K, F.decode_q3_k, 3.5625),
    TypeTraits(F.Q4_K, "q4_k", L.Q4K, F.decode_q4_k_parts, 4.625),
    TypeTraits(F.Q5_K, "q5_k", L.Q5F, F.decode_q5_k, 7.0),
    TypeTraits(F.Q6_K, "q6_k", L.Q6, F.decode_q6_k, 7.0),
    TypeTraits(F.MXFP4, "mxfp4", L.MX4, F.decode_mxfp4, 4.25),
)}


def type_traits(qtype, name: str = "") -> TypeTraits:
    """``TYPE_TRAITS[qtype]``.

    Raises:
        ValueError: a type with no record (``name``: the tensor, for the message), listing the supported ones.
    """
    t = TYPE_TRAITS.get(GGMLQuantizationType(qtype))
    if t is None:
        raise ValueError(f"{name + ': ' if name else ''}unsupported GGML type {GGMLQuantizationType(qtype).name}; "
                         f"kept in their own bits: {', '.join(q.name for q in TYPE_TRAITS)}")
    return t


def concat_parts(parts_list: list) -> tuple:
    """Several tensors' decoded parts (same layout) -> one tuple, each array's rows stacked in order."""
    return tuple(np.concatenate([np.asarray(p[i]) for p in parts_list]) for i in range(len(parts_list[0])))
