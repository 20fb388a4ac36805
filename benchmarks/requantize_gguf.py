"""``python -m benchmarks.requantize_gguf SRC DST --type Q6_K [--only ffn_down]``: a copy of a GGUF file with some 2-D
weights re-quantized to a K-quant (``kvserve.quant.kquantize``), every metadata field and other tensor as it was.

A weight is re-quantized when its name contains one of ``--only`` (default: every 2-D weight) and its rows are
whole 256-value super-blocks; the others keep their type (SmolLM2-135M's hidden size 576 is not a multiple of 256,
so only its ``ffn_down`` weights, 1536 wide, can be K-quants: llama.cpp's quantizer falls back to another type for
such tensors too). Used by ``tests/model/test_kquant_model.py`` and for the accuracy table in docs/quantization.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import gguf
from kvserve.quant import formats
from kvserve.quant.kquantize import quantize_q5_k, quantize_q6_k

def _bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as uint8 ``[N, 2K]`` (round to nearest even; the values here are finite)."""
    u = np.asarray(w, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").view(np.uint8)


QUANTIZERS = {"Q6_K": quantize_q6_k, "Q5_K": quantize_q5_k,
              "F16": lambda w: np.ascontiguousarray(np.asarray(w, np.float16)).view(np.uint8), "BF16": _bf16_bits}
_BLOCK = {"Q6_K": 256, "Q5_K": 256, "F16": 1, "BF16": 1}
_SKIP_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def _float(t) -> np.ndarray:
    """A tensor of the reader as float32 ``[rows, cols]`` (row-major)."""
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        return np.asarray(t.data, np.float32)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)


def requantize(src: Path, dst: Path, qtype: str, only: Optional[Sequence[str]] = None) -> dict:
    """Write ``dst``: ``src`` with its 2-D weights named by ``only`` (all if ``None``) and of rows a multiple of
    256 re-quantized to ``qtype`` (``"Q6_K"``, ``"Q5_K"``; or stored as ``"F16"`` / ``"BF16"``). Returns
    ``{tensor name: type name}`` of the result.

    Raises:
        ValueError: an unknown ``qtype``.
    """
    if qtype not in QUANTIZERS:
        raise ValueError(f"qtype must be one of {sorted(QUANTIZERS)}, got {qtype!r}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name in _SKIP_FIELDS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    types = {}
    for t in reader.tensors:
        shape = [int(s) for s in reversed(t.shape)]  # row-major
        pick = len(shape) == 2 and shape[1] % _BLOCK[qtype] == 0 and (only is None or any(o in t.name for o in only))
        if pick:
            raw = QUANTIZERS[qtype](_float(t).reshape(shape))
            writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
            types[t.name] = qtype
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            types[t.name] = t.tensor_type.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--type", default="Q6_K", choices=sorted(QUANTIZERS))
    p.add_argument("--only", default=None, help="comma-separated name fragments (default: every 2-D weight)")
    a = p.parse_args(argv)
    types = requantize(Path(a.src), Path(a.dst), a.type, a.only.split(",") if a.only else None)
    counts = {}
    for v in types.values():
        counts[v] = counts.get(v, 0) + 1
    print(f"wrote {a.dst}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
