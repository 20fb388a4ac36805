"""Read a GGUF file's tensors keeping quantized ones in their block format (no float32 copy of them is made).

``read_gguf_tensors(path)`` maps each tensor name (GGUF naming, e.g. ``blk.0.attn_q.weight``) to a ``QuantTensor``
for the block formats of ``formats.QUANTIZED_TYPES`` -- a read-only view of the file's bytes through
``gguf.GGUFReader``'s memory map, so nothing is read until used -- and to a float32 ``numpy`` array for F32, F16 and
BF16 tensors (norms: small).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from gguf import GGMLQuantizationType, GGUFReader

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


def read_gguf_tensors(path: Union[str, Path]) -> dict:
    """Every tensor of a GGUF file: name -> ``QuantTensor`` (block formats, memory-mapped bytes) or float32
    ``numpy`` array (F32 / F16 / BF16, shape in row-major order).

    Raises:
        ValueError: the file cannot be parsed, or holds a tensor in a format kvserve does not read (name and type
            in the message).
    """
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means an unreadable file
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    return {t.name: reader_tensor(t) for t in reader.tensors}


def reader_tensor(t) -> Union["QuantTensor", np.ndarray]:
    """One ``GGUFReader`` tensor as ``read_gguf_tensors`` returns it (``ValueError`` for an unsupported type)."""
    shape = tuple(int(s) for s in reversed(t.shape))
    if t.tensor_type in formats.QUANTIZED_TYPES:
        if len(shape) != 2:
            raise ValueError(f"{t.name}: quantized tensors must be 2-D, got shape {list(shape)}")
        raw = t.data.reshape(shape[0], -1)
        return QuantTensor(t.name, GGMLQuantizationType(t.tensor_type), raw, shape)
    if t.tensor_type == GGMLQuantizationType.F32:
        return np.asarray(t.data, np.float32).reshape(shape)
    elif t.tensor_type == GGMLQuantizationType.F16:
        return np.asarray(t.data).view(np.float16).astype(np.float32).reshape(shape)
    elif t.tensor_type == GGMLQuantizationType.BF16:
        bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    raise ValueError(f"{t.name}: GGML type {GGMLQuantizationType(t.tensor_type).name} is not supported; "
                     f"supported: F32, F16, BF16, {', '.join(q.name for q in formats.QUANTIZED_TYPES)}")
