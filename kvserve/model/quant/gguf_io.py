"""Read a GGUF file's tensors keeping quantized ones in their block format (no float32 copy of them is made).

``GGUFFile(path)`` parses the header, the metadata and the tensor table with ``struct`` (GGUF spec v2/v3,
``ggml/docs/gguf.md``) and memory-maps the data. ``gguf.GGUFReader`` builds a numpy view per metadata item --
~100,000 of them for a 49k-token vocabulary with its merges -- which made it the slowest step of start-up
(docs/benchmarks.md, start-up).

``read_gguf_tensors(path)`` maps each tensor name (GGUF naming, e.g. ``blk.0.attn_q.weight``) to a ``QuantTensor``
for the block formats of ``formats.QUANTIZED_TYPES`` -- a read-only view of the file's memory-mapped bytes, so
nothing is read until used -- and to a float32 ``numpy`` array for F32, F16 and BF16 tensors (norms: small).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.model.quant import formats


@dataclass(frozen=True)
class QuantTensor:
    """A 2-D tensor in a GGUF block format.

    Attributes:
        name: the tensor's name in the file.
        qtype: its ``gguf.GGMLQuantizationType`` (one of ``formats.QUANTIZED_TYPES``).
        raw: ``uint8 [out_features, bytes_per_row]``: each row is ``in_features / values_per_block`` blocks.
        shape: ``(out_features, in_features)`` (row-major; GGUF lists it reversed).
    """

    name: str
    qtype: GGMLQuantizationType
    raw: np.ndarray
    shape: tuple

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def nbytes(self) -> int:
        """Bytes of the blocks (what a matmul reads)."""
        return self.raw.nbytes

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 ``[len(rows) or out_features, in_features]``, equal to ``gguf.quants.dequantize``; ``rows``: an
        index array (e.g. token ids for an embedding lookup) to decode only those rows."""
        raw = self.raw if rows is None else self.raw[np.asarray(rows)]
        return formats.dequantize(raw, self.qtype, self.in_features)

    def take_rows(self, index: np.ndarray) -> "QuantTensor":
        """The tensor with its rows reordered (``new[i] = old[index[i]]``): exact, rows are independent blocks.
        Makes a copy of the bytes (``raw`` becomes an ordinary array)."""
        return QuantTensor(self.name, self.qtype, np.ascontiguousarray(self.raw[np.asarray(index)]),
                           (len(index), self.in_features))


def rope_unpermute_index(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved RoPE pairs -> Hugging Face rotate-half),
    the same as ``kvserve.model.loader._unpermute_rope_rows``: ``w_hf = w_gguf[index]``."""
    head_dim = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, head_dim // 2, 2).swapaxes(1, 2).reshape(n_rows)


# GGUF metadata value types (gguf.md "gguf_metadata_value_type") -> struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_U64 = struct.Struct("<Q")
_NP_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
             12: "<f8"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF file's tensor table.

    Attributes:
        name: e.g. ``blk.0.attn_q.weight``.
        shape: row-major (the file lists dimensions innermost first; this is reversed).
        tensor_type: the ``GGMLQuantizationType``.
        offset: absolute byte offset of the data in the file.
        nbytes: bytes of the data.
    """

    name: str
    shape: tuple
    tensor_type: GGMLQuantizationType
    offset: int
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: ``fields`` (metadata key -> value: int / float / bool / str, a list of str, or a numpy
    array for numeric arrays), ``tensors`` (``GGUFTensorInfo`` in file order) and the memory-mapped bytes.

    Args:
        path: the ``.gguf`` file.

    Raises:
        ValueError: not a GGUF file (magic), an unsupported version (2 and 3 are read), a truncated or malformed
            header, or tensor data beyond the end of the file.
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e
        buf = memoryview(self._mm)
        try:
            self.fields, self.tensors, self.data_offset = _parse(buf)
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e
        for t in self.tensors:
            if t.offset + t.nbytes > len(self._mm):
                raise ValueError(f"cannot read GGUF file {str(path)!r}: tensor {t.name} ends at byte "
                                 f"{t.offset + t.nbytes}, past the end of the file ({len(self._mm)} bytes)")

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key``, or ``default`` when absent."""
        return self.fields.get(key, default)

    def tensor_bytes(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8, a read-only view of the memory map (nothing is read until used)."""
        return self._mm[t.offset: t.offset + t.nbytes]

    def tensor(self, t: GGUFTensorInfo) -> Union["QuantTensor", np.ndarray]:
        """``t`` as ``read_gguf_tensors`` returns it: a ``QuantTensor`` or a float32 array (``ValueError`` for an
        unsupported type)."""
        return _as_tensor(t, self.tensor_bytes(t))


def _parse(buf: memoryview) -> tuple:
    """Header, metadata and tensor table of a GGUF buffer -> ``(fields, tensors, data_offset)``."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2, 3)")
    pos = 24

    def string(pos):
        (n,) = struct.unpack_from("<Q", buf, pos)
        return str(buf[pos + 8: pos + 8 + n], "utf-8"), pos + 8 + n

    def value(vtype, pos):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == 8:
            return string(pos)
        if vtype == 9:
            etype, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _NP_TYPES:
                arr = np.frombuffer(buf, _NP_TYPES[etype], n, pos)
                return (arr.astype(bool) if etype == 7 else arr), pos + arr.nbytes
            items = []
            if etype == 8:  # strings (a vocabulary, merges): the hot loop of a parse, kept tight
                u64 = _U64.unpack_from
                for _ in range(n):
                    (ln,) = u64(buf, pos)
                    items.append(str(buf[pos + 8: pos + 8 + ln], "utf-8"))
                    pos += 8 + ln
                return items, pos
            for _ in range(n):
                v, pos = value(etype, pos)
                items.append(v)
            return items, pos
        raise ValueError(f"unknown metadata value type {vtype}")

    fields = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = value(vtype, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(int(d) for d in reversed(dims)), GGMLQuantizationType(ttype), offset))
    align = int(fields.get("general.alignment", 32))
    data_offset = -(-pos // align) * align
    tensors = []
    for name, shape, ttype, offset in infos:
        per_block, block_bytes = GGML_QUANT_SIZES[ttype]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        tensors.append(GGUFTensorInfo(name, shape, ttype, data_offset + offset, n // per_block * block_bytes))
    return fields, tensors, data_offset


def read_gguf_tensors(path: Union[str, Path]) -> dict:
    """Every tensor of a GGUF file: name -> ``QuantTensor`` (block formats, memory-mapped bytes) or float32
    ``numpy`` array (F32 / F16 / BF16, shape in row-major order).

    Raises:
        ValueError: the file cannot be parsed, or holds a tensor in a format kvserve does not read (name and type
            in the message).
    """
    f = GGUFFile(path)
    return {t.name: f.tensor(t) for t in f.tensors}


def _as_tensor(t: GGUFTensorInfo, data: np.ndarray) -> Union["QuantTensor", np.ndarray]:
    """One tensor's bytes (``data`` uint8) as ``read_gguf_tensors`` returns it (``ValueError`` for an unsupported
    type)."""
    shape = t.shape
    if t.tensor_type in formats.QUANTIZED_TYPES:
        if len(shape) != 2:
            raise ValueError(f"{t.name}: quantized tensors must be 2-D, got shape {list(shape)}")
        raw = data.reshape(shape[0], -1)
        return QuantTensor(t.name, GGMLQuantizationType(t.tensor_type), raw, shape)
    if t.tensor_type == GGMLQuantizationType.F32:
        return np.asarray(data).view("<f4").reshape(shape)
    elif t.tensor_type == GGMLQuantizationType.F16:
        return np.asarray(data).view("<f2").astype(np.float32).reshape(shape)
    elif t.tensor_type == GGMLQuantizationType.BF16:
        bits = np.asarray(data).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    raise ValueError(f"{t.name}: GGML type {GGMLQuantizationType(t.tensor_type).name} is not supported; "
                     f"supported: F32, F16, BF16, {', '.join(q.name for q in formats.QUANTIZED_TYPES)}")
