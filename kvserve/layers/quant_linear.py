"""Linear methods over quantized weights, with the call interface of ``kvserve.layers.linear.Linear``:
``layer(x [T, in_features] float32) -> [T, out_features] float32``, ``numel()``, ``path``, ``out_features``,
``in_features``.

``make_linear_method(weight, quantization)`` is the one entry point:

- ``QuantTensor`` Q4_0 / Q4_1, ``"auto"`` / ``None``: ``QuantLinear``, the file's nibbles and scales repacked
  (exact); path ``q4/<isa>``.
- ``QuantTensor`` Q8_0, ``"auto"``: ``QuantLinear``, the file's int8 values and scales (exact); ``q8/<isa>``.
- ``QuantTensor`` IQ4_NL, ``"auto"``: ``QuantLinear``, the grid's int8 values in Q8 blocks with the file's scales
  (exact, 8.5 bits per weight against the file's 4.5); ``iq4_nl/<isa>``.
- ``QuantTensor`` Q5_0 / Q5_1, ``"auto"``: ``QuantLinear``, the 5-bit values in Q5F blocks with float32 ``d``,
  ``m = -16 d`` / the file's ``m`` (exact, 7 bits per weight against 5.5 / 6); ``q5_0/<isa>``, ``q5_1/<isa>``.
- ``QuantTensor`` Q4_K, ``"auto"``: ``QuantLinear``, the file's nibbles, 6-bit sub-block scales and mins and float16
  super-block scales (Q4K blocks: exact, 4.625 bits per weight against the file's 4.5); ``q4_k/<isa>``.
- ``QuantTensor`` Q2_K, ``"auto"``: ``QuantLinear``, the file's 2-bit values, 4-bit sub-block scales and mins and
  float16 super-block scales (Q2K blocks: exact, 2.625 bits per weight as the file); ``q2_k/<isa>``.
- ``QuantTensor`` Q6_K, ``"auto"``: ``QuantLinear``, the file's 6-bit values, int8 sub-block scales and float16
  super-block scales (exact, 7 bits per weight); ``q6_k/<isa>``.
- ``QuantTensor`` Q5_K, ``"auto"``: ``QuantLinear``, the file's 5-bit values with float32 sub-block scales and
  mins (exact, 7 bits per weight); ``q5_k/<isa>``.
- any ``QuantTensor``, ``"fp32"``: ``kvserve.layers.linear.Linear`` on the dequantized weight (today's path);
  ``kvserve`` / ``onednn`` / ``mkl``.
- anything, ``"int8"``: ``QuantLinear``, symmetric int8 quantized at load, one float16 scale per 32 weights of each
  output channel (``pack.quantize_q8_blocks``, llama.cpp's Q8_0); ``int8/<isa>``. With exact activations one scale
  per whole output channel measured 97.1% top-1 agreement with ``"fp32"`` on SmolLM2 and per-32-block scales 98.6%
  (docs/quantization.md, "Accuracy"), at the same 8.5 bits per weight the packed layout stored anyway.
- ``QuantTensor`` F16 / BF16 (a GGUF's 16-bit weights), ``"auto"``: ``kvserve.layers.linear.linear_16bit``, the
  16 bits kept, float32 activations and sums; ``f16/kvserve``, ``bf16/kvserve``.
- a float ``[N, K]`` tensor / array, ``"auto"`` / ``"fp32"``: ``kvserve.layers.linear.Linear``.
- a list of the above: one fused layer (``make_linear_method``).

Activations are quantized per 32-block to int8 inside the kernel (``kernels.qgemm``), so outputs differ from a
float64 product with the dequantized weight by the activation rounding: at most ``sum_k |w_k| d_x(k) / 2`` per
output (``d_x`` = the block's ``max|x| / 127``), plus float32 rounding.

Which kernel path runs, and how activations are quantized, is the engine's ``kernels.QuantPath`` (chosen once
from ``KernelConfig``). When no quantized kernel can run here (no usable ISA path, ``cpu_kernels=False``), a
``QuantLinear`` computes with the float32 ``Linear`` on the weight it represents (``path`` ``fp32_fallback``), same
values up to the activation rounding.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from kvserve.kernels import qgemm as kernels
from kvserve.layers.linear import Linear, linear_16bit
from kvserve.quant import formats
from kvserve.quant import pack as P
from kvserve.quant import traits
from kvserve.quant.gguf_io import QuantTensor

#: Allowed values of ``quantization`` (``None`` means ``"auto"``: the weight's own format).
QUANTIZATION_METHODS = ("auto", "fp32", "int8")
# Rows decoded at a time when a GGUF tensor is re-quantized, so no whole-tensor float32 copy exists.
_CHUNK_ROWS = 1024


def check_quantization(quantization: Optional[str]) -> str:
    """``None`` -> ``"auto"``; one of ``QUANTIZATION_METHODS`` -> itself.

    Raises:
        ValueError: anything else, naming the field and the allowed values.
    """
    if quantization is None:
        return "auto"
    if not isinstance(quantization, str) or quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(repr(m) for m in QUANTIZATION_METHODS)} "
                         f"(or None = 'auto'), got {quantization!r}")
    return quantization


def unpack(w: P.PackedWeight) -> np.ndarray:
    """The float32 ``[out_features, in_features]`` weight a ``PackedWeight`` represents (inverse of packing):
    Q4 ``d * q + m``, Q8 ``d * q`` (times ``oscale``), Q6 ``(d * sc) * (q - 32)``, in float32 as ``gguf``
    dequantizes."""
    return unpack_rows(w, np.arange(w.out_features))


def unpack_rows(w: P.PackedWeight, rows: np.ndarray) -> np.ndarray:
    """Rows of the weight a ``PackedWeight`` represents, without decoding the others: float32
    ``[len(rows), in_features]`` for an int ``rows [T]`` in ``[0, out_features)`` (``unpack``: all of them; an
    embedding lookup from a tied LM head's packed bytes: a few).

    Raises:
        IndexError: a row outside ``[0, out_features)``.
    """
    rows = np.asarray(rows, np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= w.out_features):
        raise IndexError(f"rows must be in [0, {w.out_features}), got {rows.min()}..{rows.max()}")
    full = traits.LAYOUT_TRAITS[w.fmt].unpack(w, rows)
    return np.ascontiguousarray(full[:, : w.in_features])


class QuantLinear:
    """A bias-free linear layer over a ``PackedWeight`` (4- or 8-bit blocks), computed by ``kernels.qgemm``.

    Args:
        packed: the weight (``pack.pack_q4`` / ``pack.pack_q8``); ``in_features`` of the caller may be smaller
            than ``packed.in_features`` (zero-padded to a multiple of 32 for "int8"), see ``in_features``.
        kind: a label for ``path`` (``"q4"``, ``"q4_k"``, ``"q6_k"``, ``"q5_k"``, ``"q8"``, ``"int8"``).
        in_features: the true input width (default ``packed.in_features``); inputs are zero-padded to the packed
            width.
        activations: how the kernel quantizes each input row, a key of ``kernels.ACTIVATIONS`` (``"int8"``,
            ``"int8x2"``); default: the path's ``kernels.DEFAULT_ACTIVATIONS``.
        isa: the kernel path, a key of ``kernels.ISAS`` (chosen and self-checked by ``kernels.choose_path``),
            ``None`` for none (the float32 fallback), or ``"auto"`` (default): the best of this CPU.
        use_kernels: the fallback may use kvserve's float32 matmul kernel (``cpu_kernels``).

    Attributes:
        path: ``"<kind>/<isa>"`` (isa a key of ``kernels.ISAS``: ``amx_int8``, ``avx512_vnni`` or ``avx2``), with
            ``"+a16"`` when activations are ``"int8x2"`` (``q4/amx_int8+a16``), ``"+bf16"`` when they are ``"bf16"``
            and the format has a bfloat16 decoder (``q4/amx_int8+bf16``), or ``"<kind>/fp32_fallback"`` when
            no quantized kernel can run here.
        activations: the activation quantization in use.
        isa: the kernel path in use, or ``None`` (the float32 fallback).
        packed: the ``PackedWeight``.

    Call with ``x [T, in_features]`` float32 -> ``[T, out_features]`` float32.

    Raises:
        ValueError: an unknown ``activations``.
    """

    def __init__(self, packed: P.PackedWeight, kind: str, in_features: Optional[int] = None,
                 activations: Optional[str] = None, isa: Optional[str] = "auto", use_kernels: bool = True):
        self.packed = packed
        self.isa = kernels.isa() if isa == "auto" else isa
        self.activations = kernels.check_activations(activations or kernels.DEFAULT_ACTIVATIONS.get(self.isa, "int8"))
        self.out_features = packed.out_features
        self.in_features = packed.in_features if in_features is None else in_features
        self._fallback = None
        if self.isa is None:
            w = unpack(packed)[:, : self.in_features]
            self._fallback = Linear(torch.from_numpy(np.ascontiguousarray(w)), use_kernels=use_kernels)
        if self.activations == "bf16" and self.isa is not None and not kernels.activations_supported(self.isa, "bf16"):
            raise ValueError(f"activations='bf16' needs the amx_int8 path on a CPU with AMX-BF16, got isa {self.isa!r}")
        self.path = (f"{kind}/{self.isa}{kernels.path_suffix(self.activations, packed.fmt)}" if self.isa
                     else f"{kind}/fp32_fallback")
        # Everything a call needs, resolved once (a decode step makes ~120 small calls: per-call Python counts).
        self._n_pad = packed.data.shape[0] * P.G
        if self.isa is not None:
            self._call = functools.partial(
                kernels.load().kvserve_qgemm, packed.fmt, kernels.ISAS[self.isa], kernels.ACTIVATIONS[self.activations])
            self._wptr = packed.data.data_ptr()
            self._optr = None if packed.oscale is None else packed.oscale.data_ptr()

    def numel(self) -> int:
        """Weights (= multiply-adds per row): ``out_features * in_features``."""
        return self.out_features * self.in_features

    @property
    def kernel_weight(self) -> Optional[P.PackedWeight]:
        """The packed weight as the C kernels read it, when this layer runs on a kernel path with no padded inputs
        or outputs (what the fused layer loop can take); else ``None``."""
        pw = self.packed
        if self.isa is None or self.in_features != pw.in_features or pw.data.shape[0] * P.G != pw.out_features:
            return None
        return pw

    def weight_bytes(self) -> int:
        """Bytes of packed weights and scales read per call."""
        return self.packed.nbytes()

    def dequantized(self) -> np.ndarray:
        """float32 ``[out_features, in_features]``: the weight this layer multiplies by (a new array)."""
        return np.ascontiguousarray(unpack(self.packed)[:, : self.in_features])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fallback is not None:
            return self._fallback(x)
        k = self.packed.in_features
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != k:
            x = x.to(torch.float32).contiguous()
            if x.shape[1] != k:
                x = torch.nn.functional.pad(x, (0, k - x.shape[1]))
        m, n_pad = x.shape[0], self._n_pad
        y = torch.empty(m, n_pad, dtype=torch.float32)
        if self._call(x.data_ptr(), m, k, self._wptr, n_pad, self._optr, y.data_ptr(), n_pad):
            raise RuntimeError(f"kvserve_qgemm refused x {list(x.shape)} for weight {self.out_features}x{k}")
        return y if n_pad == self.out_features else y[:, : self.out_features]


def _int8_from_float(w: np.ndarray, path: kernels.QuantPath) -> QuantLinear:
    n, k = w.shape
    k_pad = -(-k // P.QK) * P.QK
    if k_pad != k:
        w = np.concatenate([w, np.zeros((n, k_pad - k), np.float32)], axis=1)
    return QuantLinear(P.pack_q8(*P.quantize_q8_blocks(w)), "int8", in_features=k, **_path_args(path))


def _chunked(t: QuantTensor, fn) -> tuple:
    """Apply ``fn(float32 rows) -> tuple of arrays`` to row chunks of a decoded ``QuantTensor``; concatenate."""
    parts = [fn(t.dequantize(np.arange(r, min(r + _CHUNK_ROWS, t.out_features))))
             for r in range(0, t.out_features, _CHUNK_ROWS)]
    return tuple(np.concatenate(p) for p in zip(*parts))


def _canonical(t: QuantTensor, quantization: str) -> tuple:
    """One GGUF tensor -> ``(kind, fmt, parts)``: the layer kind, the kernel layout's format id and the arrays its
    ``pack`` takes (``traits``: one row per output in each, so a fused projection's parts concatenate).

    Raises:
        ValueError: a GGUF type with no ``traits.TYPE_TRAITS`` record.
    """
    if quantization == "int8" and t.qtype in formats.QUANTIZED_TYPES:  # GGUF rows are whole blocks: K % 32 == 0
        return "int8", P.FMT_Q8, _chunked(t, P.quantize_q8_blocks)
    tt = traits.type_traits(t.qtype, t.name)
    return tt.kind, tt.layout.fmt, tt.decode(t.raw, t.in_features)


class ConcatLinear:
    """Several linear layers on the same input, outputs concatenated (a fused projection whose parts could not be
    packed together: mixed formats such as Q4_K q/k with a Q6_K v). Same call interface as ``Linear``."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.path = "+".join(p.path for p in parts)

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1)


def make_linear_method(weight, quantization: Optional[str] = None, path: Optional[kernels.QuantPath] = None,
                       use_kernels: bool = True):
    """Build the linear layer for one weight (table in the module docstring), or for a fused projection.

    Args:
        weight: a ``QuantTensor`` (from ``gguf_io.read_gguf_tensors``, Q/K rows already reordered with
            ``take_rows`` if needed), a float ``[out_features, in_features]`` torch tensor / numpy array, or a
            list of either (a fused projection such as q/k/v or gate/up: the parts' rows stacked in order, as
            ``torch.cat`` of their weights). A list of ``QuantTensor`` whose formats share a packed layout (Q4_0
            and Q4_1; Q8_0; Q4_K; Q5_K; Q6_K; anything under "int8") is packed as one weight; otherwise the parts
            become a ``ConcatLinear``.
        quantization: ``None`` / ``"auto"`` (the weight's own format), ``"fp32"``, or ``"int8"``.
        path: the quantized kernels' ``QuantPath`` (default ``kernels.default_path()``).
        use_kernels: float layers may use kvserve's float32 matmul kernel (``cpu_kernels``).

    Returns:
        An object with ``__call__(x [T, in] float32) -> [T, out] float32``, ``numel()``, ``path``,
        ``out_features``, ``in_features``: ``QuantLinear``, ``ConcatLinear`` or ``kvserve.layers.linear.Linear``.

    Raises:
        ValueError: a bad ``quantization`` (the field and the allowed values in the message), a weight that is not
            2-D, parts with different ``in_features``, or a GGUF type that is not one of ``formats.QUANTIZED_TYPES``.
    """
    quantization = check_quantization(quantization)
    path = kernels.default_path() if path is None else path
    parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    if not parts:
        raise ValueError("make_linear_method needs at least one weight")
    if any(isinstance(p, QuantTensor) for p in parts):
        if not all(isinstance(p, QuantTensor) for p in parts):
            raise ValueError("a fused projection mixes GGUF tensors and float tensors")
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"fused parts differ in in_features: {[p.shape for p in parts]}")
        if quantization == "fp32":
            return Linear(torch.from_numpy(np.concatenate([p.dequantize() for p in parts])), use_kernels=use_kernels)
        if quantization == "auto" and any(p.qtype in formats.FLOAT16_TYPES for p in parts):
            if len({p.qtype for p in parts}) > 1:
                return ConcatLinear([make_linear_method(p, quantization, path, use_kernels) for p in parts])
            bits = np.concatenate([p.raw for p in parts]).view("<u2")  # F16 / BF16: the file's 16 bits, as they are
            dtype = torch.bfloat16 if parts[0].qtype == formats.BF16 else torch.float16
            return linear_16bit(torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(dtype), use_kernels)
        canon = [_canonical(p, quantization) for p in parts]
        if len({(c[1], c[0] == "int8") for c in canon}) > 1:  # layouts differ: one packed weight per part
            return ConcatLinear([_pack(c, path, use_kernels) for c in canon])
        kind = "+".join(dict.fromkeys(c[0] for c in canon))
        return _pack((kind, canon[0][1], traits.concat_parts([c[2] for c in canon])), path, use_kernels)
    ws = [p if isinstance(p, np.ndarray) else p.detach().cpu().float().numpy() for p in parts]
    if any(w.ndim != 2 for w in ws) or len({w.shape[1] for w in ws}) != 1:
        raise ValueError(f"linear weights must be 2-D [out_features, in_features] with one in_features, got "
                         f"shapes {[list(w.shape) for w in ws]}")
    w = np.ascontiguousarray(np.concatenate(ws) if len(ws) > 1 else ws[0], np.float32)
    if quantization == "int8":
        return _int8_from_float(w, path)
    return Linear(torch.from_numpy(w) if len(ws) > 1 or isinstance(weight, np.ndarray)
                  else weight.float().contiguous(), use_kernels=use_kernels)


def _path_args(path: kernels.QuantPath, use_kernels: bool = True) -> dict:
    """``QuantLinear``'s keyword arguments for ``path``."""
    return dict(isa=path.isa, activations=path.activations, use_kernels=use_kernels)


def _pack(c: tuple, path: kernels.QuantPath, use_kernels: bool = True) -> QuantLinear:
    """``(kind, fmt, parts)`` (``_canonical``) -> a ``QuantLinear`` over the layout's packed weight."""
    kind, fmt, parts = c
    return QuantLinear(traits.LAYOUT_TRAITS[fmt].pack(*parts), kind, **_path_args(path, use_kernels))


def weight_formats(parts: list, layer) -> list:
    """``[(format, path)]`` per weight of a built layer: ``format`` the GGUF type name of a ``QuantTensor`` part, or
    ``"float"``, and ``path`` the ``path`` of the layer (or of its ``ConcatLinear`` part) that computes with it."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
    paths = [p.path for p in layer.parts] if isinstance(layer, ConcatLinear) else [layer.path] * len(parts)
    return [(p.qtype.name if isinstance(p, QuantTensor) else "float", path) for p, path in zip(parts, paths)]


def _runs_as(path: str) -> str:
    kind = path.split("/")[0]
    if kind.startswith("q8_from_") or kind == "int8":
        return "re-quantized to int8 per 32 weights, not the file's values"
    if "/" not in path or path.endswith("fp32_fallback"):
        return "float32 (4 bytes a weight)"
    return "exact"


def describe_weight_formats(records: list) -> str:
    """One log line from ``weight_formats`` records: per format, how many weights run on which path and whether
    that is the file's values, e.g. ``"Q6_K: 30 tensors on q6_k/avx512_vnni (exact); float: 1 tensor on
    kvserve (float32 (4 bytes a weight))"``."""
    counts: dict = {}
    for fmt, path in records:
        counts[(fmt, path)] = counts.get((fmt, path), 0) + 1
    return "; ".join(f"{fmt}: {n} tensor{'s' if n != 1 else ''} on {path} ({_runs_as(path)})"
                     for (fmt, path), n in sorted(counts.items()))


class QuantEmbedding:
    """Token embedding lookup from a ``QuantTensor`` (e.g. ``token_embd.weight``, Q8_0 in the default model):
    only the looked-up rows are decoded.

    Call with ``ids [T]`` int -> ``[T, hidden]`` float32, equal to the rows of ``gguf.quants.dequantize``.

    Args:
        table: the embedding's blocks (a view of the memory-mapped GGUF file).
        tied_head: the LM head built from the same tensor (tied embeddings), or ``None``. When it holds the file's
            values exactly (a ``QuantLinear`` of kind ``q8`` over Q8_0, ``q4`` over Q4_1 or ``q6_k`` over Q6_K; checked on a few
            rows), rows are decoded from its packed bytes, which every decode step reads anyway, so they are in
            memory: by ``kvserve_q_unpack_rows`` in C where the quantized kernels load (one call, where numpy's
            dozen calls cost ~0.1 ms in a decode step, after the weights have left the caches), else by
            ``unpack_rows``; the same bits. Otherwise each lookup reads its rows from the file
            (``QuantTensor.dequantize``), which costs a disk read per row not yet in the page cache (~2-5 ms on
            this project's virtual disk) when the packed weights came from the ``weight_cache`` and the file
            itself was never read.

    Raises:
        IndexError: an id outside ``[0, vocab)`` (from the head; the file path also takes negative ids, from the end).
    """

    def __init__(self, table: QuantTensor, tied_head=None):
        self.table = table
        self.head = tied_head.packed if _holds_table(tied_head, table) else None
        self._kernel = None  # qgemm.c's kvserve_q_unpack_rows (one C call per lookup), else unpack_rows (numpy)
        if self.head is not None and tied_head.isa is not None:
            self._kernel = functools.partial(kernels.load().kvserve_q_unpack_rows, self.head.fmt,
                                             self.head.data.data_ptr(), self.head.out_features, self.head.in_features,
                                             None if self.head.oscale is None else self.head.oscale.data_ptr())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return torch.from_numpy(self.table.dequantize(np.asarray(ids.cpu(), np.int64)))
        if self._kernel is None:
            return torch.from_numpy(unpack_rows(self.head, np.asarray(ids.cpu(), np.int64)))
        if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.device.type != "cpu":
            ids = ids.to(device="cpu", dtype=torch.int64).contiguous()  # (few torch calls: each costs here)
        out = torch.empty(ids.numel(), self.head.in_features, dtype=torch.float32)
        rc = self._kernel(ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc == -2:
            raise IndexError(f"rows must be in [0, {self.head.out_features}), got {int(ids.min())}..{int(ids.max())}")
        if rc:
            raise RuntimeError(f"kvserve_q_unpack_rows refused a weight of {self.head.out_features}x"
                               f"{self.head.in_features}")
        return out


def _holds_table(head, table: QuantTensor) -> bool:
    """Whether ``head`` (a built LM head) decodes to exactly ``table``'s values, row for row."""
    if not isinstance(head, QuantLinear) or table.rows is not None or head.packed.oscale is not None:
        return False
    kind = head.path.split("/")[0]
    if (table.qtype, kind) not in ((formats.Q8_0, "q8"), (formats.Q4_1, "q4"), (formats.Q6_K, "q6_k")) or \
            (head.out_features, head.packed.in_features) != table.shape:
        return False
    probe = np.array([0, table.out_features // 2, table.out_features - 1])
    return np.array_equal(unpack_rows(head.packed, probe).view(np.uint32), table.dequantize(probe).view(np.uint32))
