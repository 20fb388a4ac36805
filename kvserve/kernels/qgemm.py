"""The quantized matmul library (``kvserve/kernels/csrc/qgemm.c``, with ``decoder.c``: the layer loop over it): built,
loaded, and its instruction-set path chosen at run time.

The library is compiled on first use by ``kvserve.kernels.build``, like ``kvserve.kernels.cpu``'s. It is built without any ``-m`` ISA flag: each path
carries its own ``__attribute__((target(...)))``, so one binary runs on every x86-64 CPU and the path is picked
here:

1. CPUID (``kvserve_q_isa_supported``, i.e. gcc's ``__builtin_cpu_supports``): ``avx512_vnni`` needs AVX-512 F, BW,
   VL and VNNI; ``avx2`` needs AVX2 and FMA; ``amx_int8`` needs ``avx512_vnni`` plus AMX-TILE and AMX-INT8 (CPUID
   leaf 7, EDX bits 24 and 25) *and* the kernel's grant of the tile state to this process (Linux
   ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, Linux >= 5.16; see the kernel's
   Documentation/arch/x86/xstate.rst). ``amx_int8`` computes 16 rows of a group with AMX tiles (``TDPBSUD`` /
   ``TDPBSSD``, Intel SDM vol. 2, and the Intel AMX chapter of the optimization manual) and gives results equal,
   bit for bit, to ``avx512_vnni``'s (the same integer sums, the same float epilogue).
2. The engine argument ``cpu_isa`` (``KernelConfig``; ``amx_int8``, ``avx512_vnni`` or ``avx2``) forces one path,
   e.g. to test AVX2 on an AVX-512 machine; a forced path the CPU lacks is an error (``select_isa`` raises), never a
   silent substitute.
3. Each candidate, best first, must pass a numerical self-check (``self_check``: every weight format, 1-53 rows,
   against an exact-activation float64 reference) before it is used; one that fails is skipped.

With ``cpu_kernels=False`` the engine does not use the library (``choose_path`` gives no path).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kvserve.kernels.build import build_library
from kvserve.quant import formats, layouts
from kvserve.quant import pack as P

logger = logging.getLogger(__name__)

#: The library's sources: the matmul, and the whole-layer-loop entry point that calls it
#: (``kvserve.model.fused_layers``); the header they include; the flags (no ``-m`` ISA flag: see above).
_SOURCES = ("qgemm.c", "decoder.c")
_HEADERS = ("amx_probe.h", "qgemm_amx.h", "qgemm_amx_bf16.h", "qgemm_layouts.h", "qgemm_moe.h", "qgemm_mx4.h",
            "qgemm_q2k.h")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
#: Instruction-set paths, best first, with qgemm.c's ids.
ISAS = {"amx_int8": 3, "avx512_vnni": 2, "avx2": 1}
#: Activation precisions, with qgemm.c's ids: ``"int8"`` one int8 per value and float scale per 32-block
#: (llama.cpp's Q8 activations: "W4A8"); ``"int8x2"`` a pair of int8 per value, ``x ~= d (254 q1 + q2)`` (15 bits,
#: twice the integer multiply-adds); ``"bf16"`` the activations rounded to bfloat16 and the 4-bit and Q8 weights
#: decoded to bfloat16, summed in float32 by AMX-BF16 tiles (``amx_int8`` path on a CPU with AMX-BF16 only;
#: ``qgemm_amx_bf16.h``; other formats then run their int8 tiles).
ACTIVATIONS = {"int8": 0, "int8x2": 1, "bf16": 2}
#: The layouts that ``"bf16"`` activations decode to bfloat16 (``bf16_format`` in qgemm_amx_bf16.h); a weight of
#: another layout runs with ``"int8"`` activations instead, for every M.
BF16_FORMATS = frozenset(lay.fmt for lay in (layouts.Q4, layouts.Q8, layouts.Q4F, layouts.Q5F, layouts.Q4K))


def path_suffix(activations: str, fmt: int) -> str:
    """What a layer's ``path`` adds for its activations: ``"+a16"`` (``"int8x2"``), ``"+bf16"`` (``"bf16"`` on a
    weight of ``BF16_FORMATS``; another format runs int8, so none), else nothing."""
    if activations == "int8x2":
        return "+a16"
    return "+bf16" if activations == "bf16" and fmt in BF16_FORMATS else ""


#: The activation quantization used by default on each path: one int8 per value everywhere (llama.cpp's; half the
#: integer products of the pair, and perplexity within 0.3% of the float32 path's on the default model: measured in
#: docs/quantization.md, "Accuracy").
DEFAULT_ACTIVATIONS = {"amx_int8": "int8", "avx512_vnni": "int8", "avx2": "int8"}


def _build() -> Path:
    """The library's path, compiled on first use (``build_library``)."""
    return build_library("kvserve_qgemm", _SOURCES, _HEADERS, _FLAGS)


@functools.lru_cache(maxsize=None)
def load():
    """The loaded library, or ``None`` (not x86-64, no compiler): see ``unavailable_reason``."""
    global _reason
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        _reason = f"build or load failed: {e}"
        return None
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvserve_qgemm.argtypes = [cint, cint, cint, ptr, i64, i64, ptr, i64, ptr, ptr, i64]
    lib.kvserve_qgemm.restype = cint
    lib.kvserve_moe_gemm.argtypes = [cint, cint, cint, cint, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr,
                                     i64, ptr, ptr]
    lib.kvserve_moe_gemm.restype = cint
    lib.kvserve_q_isa_supported.argtypes = [cint]
    lib.kvserve_q_isa_supported.restype = cint
    lib.kvserve_q_act_supported.argtypes = [cint, cint]
    lib.kvserve_q_act_supported.restype = cint
    lib.kvserve_q_quantize_rows.argtypes = [cint, cint, ptr, i64, i64, ptr, ptr, ptr]
    lib.kvserve_q_quantize_rows.restype = None
    lib.kvserve_q_unpack_rows.argtypes = [cint, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.kvserve_q_unpack_rows.restype = cint
    lib.kvserve_q_layout_n.restype = i64
    expected = layouts.c_constants()
    n = lib.kvserve_q_layout_n()
    got = (ctypes.c_int64 * n)()
    lib.kvserve_q_layout(got)
    if n != len(expected) or tuple(got) != tuple(v for _, v in expected):
        diff = [f"{name} {v} != {g}" for (name, v), g in zip(expected, got) if v != g]
        _reason = (f"layout mismatch between qgemm_layouts.h ({n} constants) and kvserve/quant/layouts.py "
                   f"({len(expected)}): {', '.join(diff[:5]) or 'count differs'}")
        return None
    return lib


_reason: Optional[str] = None


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` or ``isa()`` gives ``None``; ``None`` when a path is in use."""
    if load() is not None and isa() is None:
        return "no instruction-set path passed its self-check on this CPU"
    return _reason


def cpu_supports(name: str) -> bool:
    """Whether this CPU can run path ``name`` (a key of ``ISAS``), by CPUID. False without the library."""
    lib = load()
    return lib is not None and bool(lib.kvserve_q_isa_supported(ISAS[name]))


@functools.lru_cache(maxsize=None)
def select_isa(forced: Optional[str] = None) -> Optional[str]:
    """The path to use: ``forced`` if given, else the best CPU-supported path that passes ``self_check``; ``None``
    if none does (callers then fall back to float32). Cached per argument.

    Raises:
        ValueError: a forced name that is not one of ``ISAS``, or that this CPU does not support, or that fails
            its self-check (the message names the ``cpu_isa`` field).
    """
    if load() is None:
        return None
    if forced is not None:
        if forced not in ISAS:
            raise ValueError(f"cpu_isa must be one of {sorted(ISAS)} or 'auto', got {forced!r}")
        if not cpu_supports(forced):
            raise ValueError(f"cpu_isa={forced}: this CPU does not support it")
        if not self_check(forced):
            raise ValueError(f"cpu_isa={forced}: failed its numerical self-check")
        return forced
    for name in ISAS:
        if cpu_supports(name):
            if self_check(name):
                return name
            logger.warning("quantized matmul path %s failed its self-check; trying the next", name)
    return None


def isa() -> Optional[str]:
    """The best path of this CPU (``select_isa()``, computed once), or ``None``."""
    return select_isa()


@dataclass(frozen=True)
class QuantPath:
    """How quantized projections compute, chosen once per engine (``choose_path``).

    Attributes:
        isa: a key of ``ISAS``, or ``None``: no kernel (quantized layers compute in float32 on their dequantized
            weights, ``fp32_fallback``).
        activations: a key of ``ACTIVATIONS``.
    """

    isa: Optional[str]
    activations: str = "int8"


def choose_path(enabled: bool = True, cpu_isa: str = "auto", activations: str = "auto") -> QuantPath:
    """The ``QuantPath`` of ``KernelConfig``'s ``cpu_kernels``, ``cpu_isa`` and ``quant_activations``: no kernel
    when disabled or unavailable; ``"auto"`` picks the best path (``isa()``) and its ``DEFAULT_ACTIVATIONS``.

    Raises:
        ValueError: a forced path this CPU lacks or that fails its self-check; an unknown activations name.
    """
    name = None if not enabled else select_isa(None if cpu_isa == "auto" else cpu_isa)
    if activations == "auto":
        return QuantPath(name, DEFAULT_ACTIVATIONS.get(name, "int8"))
    check_activations(activations, "quant_activations")
    if name is not None and not activations_supported(name, activations):
        raise ValueError(f"quant_activations={activations!r} needs the amx_int8 path on a CPU with AMX-BF16 "
                         f"(this engine's path: {name})")
    return QuantPath(name, activations)


def activations_supported(name: str, activations: str) -> bool:
    """Whether path ``name`` (a key of ``ISAS``) runs ``activations`` on this CPU: ``"bf16"`` only on ``amx_int8``
    with AMX-BF16 (CPUID leaf 7: EDX bit 22, and AVX512-BF16) and once its own ``self_check`` passed (a failure there
    withdraws ``"bf16"`` only, never the path), the int8 ones on every path."""
    lib = load()
    if lib is None or not lib.kvserve_q_act_supported(ISAS[name], ACTIVATIONS[activations]):
        return False
    return activations != "bf16" or _bf16_checked(name)


@functools.lru_cache(maxsize=None)
def _bf16_checked(name: str) -> bool:
    ok = self_check(name, ("bf16",))
    if not ok:
        logger.warning("bf16 activations failed their self-check on %s; quant_activations='bf16' is refused", name)
    return ok


def default_path() -> QuantPath:
    """``choose_path()``: the best path of this CPU with its default activations."""
    return choose_path()


def check_activations(activations: str, field: str = "activations") -> str:
    """``activations`` if it is one of ``ACTIVATIONS``.

    Raises:
        ValueError: anything else, naming ``field`` and the allowed values.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activations!r}")
    return activations


def qgemm(x: torch.Tensor, w: P.PackedWeight, isa_name: Optional[str] = None,
          activations: str = "int8") -> torch.Tensor:
    """``x [M, K]`` float32 times the packed weight -> ``[M, out_features]`` float32 (``x @ W.T``), activations
    quantized per 32-block inside as ``activations`` (a key of ``ACTIVATIONS``).

    Args:
        x: ``[M, in_features]``, float32 (another float dtype is converted first); made contiguous if it is not.
        w: a ``pack.PackedWeight`` of any layout (``traits.LAYOUT_TRAITS``).
        isa_name: a key of ``ISAS``; default ``isa()``.
        activations: ``"int8"`` or ``"int8x2"``.

    Raises:
        ValueError: an unknown ``activations``.
        RuntimeError: no usable path, or the kernel refused the arguments / could not allocate scratch memory.
    """
    act = ACTIVATIONS[check_activations(activations)]
    name = isa_name or isa()
    lib = load()
    if name is None or lib is None:
        raise RuntimeError(f"quantized matmul unavailable: {unavailable_reason()}")
    x = x.to(torch.float32).contiguous()  # a bfloat16 engine's activations are converted, not misread
    m, k = x.shape
    n_pad = w.data.shape[0] * P.G
    y = torch.empty(m, n_pad, dtype=torch.float32)
    rc = lib.kvserve_qgemm(w.fmt, ISAS[name], act, x.data_ptr(), m, k, w.data.data_ptr(), n_pad,
                           None if w.oscale is None else w.oscale.data_ptr(), y.data_ptr(), n_pad)
    if rc != 0:
        raise RuntimeError(f"kvserve_qgemm returned {rc} (x {list(x.shape)}, weight {w.out_features}x{w.in_features})")
    return y if n_pad == w.out_features else y[:, : w.out_features]


def quantize_activations(x: np.ndarray, activations: str = "int8") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference of the kernel's activation quantization, in numpy: float32 ``[M, K]`` (K a multiple of 32) ->
    ``(q, d float32 [M, K/32], s float32 [M, K/32])``.

    ``"int8"``: ``d = max|x_block| / 127``, ``q = rint(x * (1 / d))`` (half to even, as ``nearbyintf``) clamped to
    +-127, int8 ``[M, K]``: llama.cpp's Q8_0 / Q8_1 activation blocks (``quantize_row_q8_1``). ``"int8x2"``: ``q1``
    as above, ``d = d1 / 254`` and ``q2 = rint((x - q1 d1) * (1 / d))`` (the residual; ``x - q1 d1`` with one
    rounding, as ``fmaf``), and ``q = 254 q1 + q2`` as int32 ``[M, K]`` (the kernel stores ``q1``, ``q2`` apart).
    ``s = d * sum(q_block)``, with the scales in float32. Equal to the C quantizer bit for bit
    (``tests/model/test_quant_kernels.py``)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    b = x.reshape(m, k // P.QK, P.QK)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127)
    if check_activations(activations) == "int8x2":
        resid = (b.astype(np.float64) - q * d.astype(np.float64)[..., None]).astype(np.float32)  # exact, then rounded
        d = (d / np.float32(254)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q2 = np.clip(np.rint(resid * inv[..., None]), -127, 127)
        q = q.astype(np.int32) * 254 + q2.astype(np.int32)
        s = (d * q.sum(axis=-1).astype(np.float32)).astype(np.float32)
        return q.reshape(m, k), d.astype(np.float32), s
    s = (d * q.sum(axis=-1, dtype=np.float32)).astype(np.float32)
    return q.astype(np.int8).reshape(m, k), d.astype(np.float32), s


def round_bf16(a: np.ndarray) -> np.ndarray:
    """``a`` (any float array) rounded to bfloat16, nearest even, as the kernel rounds its ``"bf16"`` operands;
    returned as float64 of the same shape."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).double().numpy()


def reference_qgemm(x: np.ndarray, w_dequant: np.ndarray, activations: str = "int8") -> np.ndarray:
    """What the kernel computes, exactly, in float64: ``x`` quantized as ``quantize_activations`` (dequantized
    back), times the dequantized weight ``[N, K]`` transposed -> ``[M, N]``. The kernel differs from it only by
    float32 summation order. ``"bf16"``: ``x`` and the weight rounded to bfloat16 (the kernel also differs by the
    tile unit's rounding, and a weight may round to a neighbouring bfloat16: see ``self_check``)."""
    if check_activations(activations) == "bf16":
        return round_bf16(x) @ round_bf16(w_dequant).T
    q, d, _ = quantize_activations(x, activations)
    xh = q.astype(np.float64).reshape(q.shape[0], -1, P.QK) * d.astype(np.float64)[..., None]
    return xh.reshape(q.shape) @ np.asarray(w_dequant, np.float64).T


def self_check(name: str, activations: tuple = ("int8", "int8x2")) -> bool:
    """Run path ``name`` on small random Q4, Q4F, Q5F, Q8, MX4 (40 x 96), Q6, Q4K, Q2K and Q3K (40 x 256) weights (1/5/13/53 rows: partial output groups, row
    tiles, and full 16-row AMX tiles with a tail), with each of ``activations`` the path runs (the integer ones
    choose the path; ``"bf16"`` is checked on its own by ``activations_supported``), and compare with ``reference_qgemm``: relative error at most 1e-5 of
    ``sum |w| |x|`` (float32 rounding of the per-block sums; ``"bf16"``: 2^-7, a weight's neighbouring bfloat16).
    False if the CPU lacks it or any output is off."""
    if not cpu_supports(name):
        return False
    rng = np.random.default_rng(12345)
    n, k = 40, 96
    q4 = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d4 = (rng.random((n, k // 32)) * 0.1 + 0.01).astype(np.float16)
    m4 = (-rng.random((n, k // 32)) * 0.5).astype(np.float16)
    q8 = rng.integers(-128, 128, (n, k), dtype=np.int16).astype(np.int8)
    d8 = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float16)
    os8 = (rng.random(n) + 0.5).astype(np.float32)
    cases = [
        (P.pack_q4(q4, d4, m4), np.repeat(d4.astype(np.float32), 32, 1) * q4 + np.repeat(m4.astype(np.float32), 32, 1)),
        (P.pack_q4(q4, d4.astype(np.float32) * 3, m4.astype(np.float32)),
         np.repeat(d4.astype(np.float32) * 3, 32, 1) * q4 + np.repeat(m4.astype(np.float32), 32, 1)),
        (P.pack_q8(q8, d8), np.repeat(d8.astype(np.float32), 32, 1) * q8),
        (P.pack_q8(q8, d8, os8), np.repeat(d8.astype(np.float32), 32, 1) * q8 * os8[:, None]),
    ]
    q6 = rng.integers(0, 64, (n, 256), dtype=np.uint8)
    sc6 = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    d6 = (rng.random((n, 1)) * 0.01 + 0.001).astype(np.float16)
    cases.append((P.pack_q6(q6, sc6, d6), np.repeat(d6.astype(np.float32) * sc6, 16, 1) * (q6.astype(np.float32) - 32)))
    q3 = rng.integers(28, 36, (n, 256), dtype=np.uint8)
    sc3 = rng.integers(-32, 32, (n, 16)).astype(np.int8)
    cases.append((P.pack_q3k(q3, sc3, d6), np.repeat(d6.astype(np.float32) * sc3, 16, 1) * (q3.astype(np.float32) - 32)))
    q5 = rng.integers(0, 32, (n, k), dtype=np.uint8)
    d5, m5 = d4.astype(np.float32) / 2, m4.astype(np.float32)
    cases.append((P.pack_q5(q5, d5, m5), np.repeat(d5, 32, 1) * q5 + np.repeat(m5, 32, 1)))
    q4k = rng.integers(0, 16, (n, 256), dtype=np.uint8)
    scmn = rng.integers(0, 64, (n, 8, 2), dtype=np.uint8)
    ddmin = (rng.random((n, 1, 2)) * 0.01 + 0.001).astype(np.float16)
    dk, mk = formats.q4_k_values(scmn, ddmin)
    cases.append((P.pack_q4k(q4k, scmn, ddmin), np.repeat(dk, 32, 1) * q4k + np.repeat(mk, 32, 1)))
    q2k = rng.integers(0, 4, (n, 256), dtype=np.uint8)
    scmn2 = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    cases.append((P.pack_q2k(q2k, scmn2, ddmin), formats.q2_k_values(q2k, scmn2, ddmin)))
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    ex = rng.integers(118, 126, (n, k // 32), dtype=np.uint8)
    wx = (P.MX4_KVALUES[codes].astype(np.float32).reshape(n, -1, 32) *
          np.ldexp(np.float32(1), ex.astype(np.int32) - 128)[..., None]).reshape(n, k)
    cases.append((P.pack_mx4(codes, ex), wx))
    for packed, wd in cases:
        k = packed.in_features
        for rows in (1, 5, 13, 53):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            x[0, :3] = (40.0, -40.0, 0.0)
            scale = np.abs(x).astype(np.float64) @ np.abs(wd.astype(np.float64)).T + 1e-30
            for act in activations:
                if not load().kvserve_q_act_supported(ISAS[name], ACTIVATIONS[act]):
                    continue
                got = qgemm(torch.from_numpy(x), packed, name, act).numpy().astype(np.float64)
                act = act if act != "bf16" or packed.fmt in BF16_FORMATS else "int8"  # (the int8 tiles run it)
                ref = reference_qgemm(x, wd, act)
                # bf16: a weight decoded with one rounding (FMA) may round to the neighbouring bfloat16 of the
                # reference's two (2^-8 of that one product at most)
                tol = 2.0 ** -7 if act == "bf16" else 1e-5
                if got.shape != ref.shape or not np.all(np.abs(got - ref) <= tol * scale):
                    return False
    return True
