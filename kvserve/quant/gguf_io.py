"""Read a GGUF file's tensors keeping quantized ones in their block format (no float32 copy of them is made).

``gguf_metadata(reader)`` turns a ``gguf.GGUFReader`` (the library's parser) into a small JSON-able dict: the
scalar metadata fields and the tensor table (name, GGML type, row-major shape, absolute data offset, bytes).
``gguf_tensors(path, meta)`` then builds every tensor from that table over a ``numpy.memmap`` of the file, so
``weight_cache.gguf_metadata_cached`` can serve a later start-up from its cached copy of the dict without
``GGUFReader`` (which builds a numpy view per metadata item -- ~100,000 for a 49k-token vocabulary with its
merges -- and is the slowest step of a first start-up; docs/performance.md, "Start-up and memory").

``read_gguf_tensors(path)`` maps each tensor name (GGUF naming, e.g. ``blk.0.attn_q.weight``) to a ``QuantTensor``
for the block formats of ``formats.QUANTIZED_TYPES`` -- a read-only view of the file's memory-mapped bytes, so
nothing is read until used -- and to a float32 ``numpy`` array for F32 tensors and 1-D F16 / BF16 ones (norms:
small); 2-D F16 / BF16 weights are ``QuantTensor`` views too (kept 16-bit by ``quant_linear``).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from kvserve.quant import formats


@dataclass(frozen=True)
class QuantTensor:
    """A 2-D tensor in a GGUF block format (or F16 / BF16: blocks of one value).

    Attributes:
        name: the tensor's name in the file.
        qtype: its ``gguf.GGMLQuantizationType`` (one of ``formats.QUANTIZED_TYPES`` for the quantized linear
            methods; ``gguf_tensors`` also wraps other block formats, which the loader dequantizes).
        source: ``uint8 [rows of the source, bytes_per_row]``: the blocks as stored (a view of the memory-mapped
            file); each row is ``in_features / values_per_block`` blocks.
        shape: ``(out_features, in_features)`` (row-major; GGUF lists it reversed).
        experts: ``0``, or the number of experts of a stacked 3-D tensor (``expert(e)`` gives one).
        rows: ``None``, or the source rows this tensor's rows are, in order (``take_rows``): applied on the first
            read of ``raw``, so a reordered tensor that is never read (its packed form served from the
            ``weight_cache``) costs neither a copy nor a read of the file's pages.
        file: ``None``, or ``(f, offset)``: ``source`` is the bytes of the open binary file ``f`` (the file the
            mapping maps) from ``offset`` on (``gguf_tensors``).
            Then ``dequantize(rows)`` -- an embedding lookup -- reads just those rows with ``os.pread`` instead
            of touching the mapping: a page fault on a mapped file maps up to 16 neighbouring pages too (the
            kernel's fault-around), so a few hundred looked-up rows would otherwise keep ~10 MB of the file in
            the resident set.
    """

    name: str
    qtype: GGMLQuantizationType
    source: np.ndarray
    shape: tuple
    rows: Optional[np.ndarray] = None
    file: Optional[tuple] = None
    experts: int = 0

    def expert(self, e: int) -> "QuantTensor":
        """Expert ``e`` of a stacked tensor (``experts > 0``: a 3-D GGUF tensor ``[experts, out, in]`` held as
        ``[experts * out, in]``): its ``[out, in]`` rows, a view of the same bytes (no copy), named
        ``<name>#<e>``.

        Raises:
            ValueError: not a stacked tensor, or ``e`` outside ``[0, experts)``.
        """
        if not self.experts or self.rows is not None:
            raise ValueError(f"{self.name} is not a stacked expert tensor")
        if not 0 <= e < self.experts:
            raise ValueError(f"expert must be in [0, {self.experts}), got {e}")
        n = self.out_features // self.experts
        src = self.source[e * n:(e + 1) * n]
        file = None if self.file is None else (self.file[0], self.file[1] + e * n * self.source.shape[1])
        return QuantTensor(f"{self.name}#{e}", self.qtype, src, (n, self.in_features), None, file)

    @functools.cached_property
    def raw(self) -> np.ndarray:
        """``uint8 [out_features, bytes_per_row]``: the blocks of this tensor's rows (``source``, or a contiguous
        copy of ``source[rows]`` made on first use and kept)."""
        return self.source if self.rows is None else np.ascontiguousarray(self.source[self.rows])

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def nbytes(self) -> int:
        """Bytes of the blocks (what a matmul reads)."""
        return self.out_features * self.source.shape[1]

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 ``[len(rows) or out_features, in_features]``, equal to ``gguf.quants.dequantize``; ``rows``: an
        index array (e.g. token ids for an embedding lookup) to decode only those rows."""
        if rows is None:
            raw = self.raw
        elif self.file is not None and (self.rows is None or "raw" not in self.__dict__):  # no copy: read the file
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            if self.rows is not None:
                rows = self.rows[rows]
            raw = _pread_rows(self.file, self.source.shape[1], self.source.shape[0], rows)
        else:
            raw = self.raw[np.asarray(rows)]
        return formats.dequantize(raw, self.qtype, self.in_features)

    def release(self) -> None:
        """Give back what reading this tensor made resident, once it is packed: the reordered copy ``raw`` made
        (if any), and the mapped file's pages of its blocks (``madvise(MADV_DONTNEED)`` on the mapping: the
        process's resident set shrinks; the pages stay in the page cache, and a later read faults them in again).
        Nothing changes what the tensor reads."""
        self.__dict__.pop("raw", None)
        m = getattr(self.source, "_mmap", None)  # numpy memmap views carry the mapping they view
        if m is None or not hasattr(m, "madvise") or not self.source.flags.c_contiguous or not self.source.nbytes:
            return
        try:
            off = self.source.ctypes.data - np.frombuffer(m, np.uint8, count=1).ctypes.data  # from the mapping's start
            lo = off // mmap.PAGESIZE * mmap.PAGESIZE
            if 0 <= lo and off + self.source.nbytes <= len(m):
                m.madvise(mmap.MADV_DONTNEED, lo, off + self.source.nbytes - lo)
        except (OSError, ValueError):  # advice only
            pass

    def take_rows(self, index: np.ndarray) -> "QuantTensor":
        """The tensor with its rows reordered (``new[i] = old[index[i]]``): exact, rows are independent blocks.
        Nothing is copied until ``raw`` is read (then a contiguous copy of the reordered bytes)."""
        index = np.asarray(index)
        rows = index if self.rows is None else self.rows[index]
        return QuantTensor(self.name, self.qtype, self.source, (len(index), self.in_features), rows, self.file)


def _pread_rows(file: tuple, row_bytes: int, n_rows: int, rows: np.ndarray) -> np.ndarray:
    """``uint8 [len(rows), row_bytes]``: rows of a tensor of ``n_rows`` rows stored at ``file = (f, offset)``
    (``f`` an open binary file), each read with one ``os.preadv`` straight into the result; negative rows count
    from the end, as numpy indexing does.

    Raises:
        IndexError: a row outside ``[-n_rows, n_rows)``; ``OSError``: the read fails.
    """
    f, offset = file
    fd = f.fileno()
    out = np.empty((len(rows), row_bytes), np.uint8)
    for i, r in enumerate(rows.tolist()):
        if r < 0:
            r += n_rows
        if not 0 <= r < n_rows:
            raise IndexError(f"rows must be in [-{n_rows}, {n_rows}), got {rows[i]}")
        if os.preadv(fd, [out[i]], offset + r * row_bytes) != row_bytes:
            raise OSError(f"short read of row {r} from {f.name!r}")
    return out


def rope_unpermute_index(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved RoPE pairs -> Hugging Face rotate-half),
    the same as ``kvserve.model.loader._unpermute_rope_rows``: ``w_hf = w_gguf[index]``."""
    head_dim = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, head_dim // 2, 2).swapaxes(1, 2).reshape(n_rows)


#: Bump when what ``gguf_metadata`` returns changes (cached copies of other versions are then rebuilt).
METADATA_VERSION = 1


def check_gguf_magic(path: Union[str, Path]) -> None:
    """Raise ``ValueError`` naming ``path`` unless it starts with the GGUF magic ``b"GGUF"`` (the GGUF spec's first
    4 bytes): a cheap check before the slow parse of ``open_gguf``."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ValueError(f"cannot read GGUF file {str(path)!r}: GGUF magic invalid (the file starts with {magic!r}, "
                         f"not b'GGUF')")


def open_gguf(path: Union[str, Path]) -> GGUFReader:
    """``gguf.GGUFReader`` over ``path`` (``ValueError`` naming the file when it cannot be parsed)."""
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means an unreadable file
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e


def gguf_metadata(reader: GGUFReader) -> dict:
    """What a load needs from a GGUF file besides its tensor bytes, JSON-able.

    Returns:
        ``{"fields": {key: int | float | bool | str} (every non-array metadata field:
        the architecture's hyperparameters, the EOS id, ...; arrays such as the vocabulary are left out),
        "tensors": [{"name", "type" (GGML type id), "shape" (row-major), "offset" (absolute, bytes),
        "nbytes"}, ...] in file order}``.
    """
    fields = {name: f.contents() for name, f in reader.fields.items()
              if f.types and f.types[0] != GGUFValueType.ARRAY}
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(s) for s in reversed(t.shape)],
                "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]
    return {"fields": fields, "tensors": tensors}


def gguf_tensors(path: Union[str, Path], meta: dict) -> dict:
    """Every tensor of ``meta["tensors"]`` (a ``gguf_metadata`` dict of this file): name -> ``QuantTensor`` (any
    block format, 2-D; over a read-only ``numpy.memmap`` of ``path``, with the open file for row reads) or a
    float32 array (F32 / F16 / BF16; read into memory of its own, so no page of the mapping is touched by a load
    that serves the quantized weights from the packed cache).

    Raises:
        ValueError: a tensor's bytes do not match its type and shape or lie past the end of the file (a stale
            table), or a block-format tensor is not 2-D.
    """
    f = open(path, "rb", buffering=0)  # noqa: SIM115 - shared by the tensors' row reads, closed when they go
    try:
        return _tensors_of(f, np.memmap(f, dtype=np.uint8, mode="r"), meta)
    except BaseException:
        f.close()
        raise


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _tensors_of(f, mm: np.ndarray, meta: dict) -> dict:
    out = {}
    for t in meta["tensors"]:
        name, shape, offset, nbytes = t["name"], tuple(int(s) for s in t["shape"]), int(t["offset"]), int(t["nbytes"])
        qtype = GGMLQuantizationType(int(t["type"]))
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64))
        if n % per_block or n // per_block * block_bytes != nbytes or offset < 0 or offset + nbytes > len(mm):
            raise ValueError(f"{name}: {nbytes} bytes at offset {offset} do not hold a {qtype.name} tensor of shape "
                             f"{list(shape)} inside the file ({len(mm)} bytes)")
        if qtype in _FLOAT_TYPES:  # read, not mapped: the loader keeps its own float copy (norms: small)
            data = np.empty(nbytes, np.uint8)
            if os.preadv(f.fileno(), [data], offset) != nbytes:
                raise ValueError(f"{name}: short read of {nbytes} bytes at offset {offset}")
        else:
            data = mm[offset: offset + nbytes]
        t = _as_tensor(name, qtype, shape, data)
        out[name] = dataclasses.replace(t, file=(f, offset)) if isinstance(t, QuantTensor) else t
    return out


def read_gguf_tensors(path: Union[str, Path]) -> dict:
    """Every tensor of a GGUF file (read with ``gguf.GGUFReader``): name -> ``QuantTensor`` (block formats,
    memory-mapped bytes; 2-D F16 / BF16 too) or float32 ``numpy`` array (F32, 1-D F16 / BF16; shape in row-major
    order).

    Raises:
        ValueError: the file cannot be parsed, or holds a tensor in a format kvserve does not read (name and type
            in the message).
    """
    tensors = gguf_tensors(path, gguf_metadata(open_gguf(path)))
    for name, t in tensors.items():
        if isinstance(t, QuantTensor) and t.qtype not in formats.QUANTIZED_TYPES:
            raise ValueError(f"{name}: GGML type {t.qtype.name} is not supported; supported: F32, F16, BF16, "
                             f"{', '.join(q.name for q in formats.QUANTIZED_TYPES)}")
    return tensors


def _as_tensor(name: str, qtype: GGMLQuantizationType, shape: tuple,
               data: np.ndarray) -> Union["QuantTensor", np.ndarray]:
    """One tensor's bytes (``data`` uint8) as ``gguf_tensors`` returns it: float32 for F32 and for 1-D F16 / BF16
    (norms), else a ``QuantTensor`` (2-D F16 / BF16 weights too; ``ValueError`` for a block format unless 2-D)."""
    if qtype == GGMLQuantizationType.F32:
        return np.asarray(data).view("<f4").reshape(shape)
    elif qtype in formats.FLOAT16_TYPES and len(shape) == 2:  # a weight: kept in 16 bits (the loader decides)
        return QuantTensor(name, qtype, np.asarray(data).reshape(shape[0], -1), shape)
    elif qtype == GGMLQuantizationType.F16:
        return np.asarray(data).view("<f2").astype(np.float32).reshape(shape)
    elif qtype == GGMLQuantizationType.BF16:
        bits = np.asarray(data).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if len(shape) == 3:  # a mixture of experts' stacked weights (llama.cpp's ffn_*_exps): [experts, out, in]
        return QuantTensor(name, qtype, data.reshape(shape[0] * shape[1], -1), (shape[0] * shape[1], shape[2]),
                           experts=shape[0])
    if len(shape) != 2:
        raise ValueError(f"{name}: quantized tensors must be 2-D (or 3-D: experts), got shape {list(shape)}")
    return QuantTensor(name, qtype, data.reshape(shape[0], -1), shape)
