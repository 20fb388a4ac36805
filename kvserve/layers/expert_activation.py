"""The gated activation of a mixture-of-experts expert, ``h [T, 2I]`` (gate columns, then up) -> ``[T, I]`` float32,
shared by the per-expert path (``kvserve.layers.moe.ExpertMLP``) and the grouped one
(``kvserve.layers.grouped_experts``) so both compute every element with the same ops:

- ``"silu"``: SwiGLU, ``silu(gate) * up`` (Shazeer 2020, "GLU variants improve Transformer"): Mixtral, Qwen-MoE,
  OLMoE, Granite-MoE.
- ``"swiglu_oai"``: gpt-oss's clamped SwiGLU as ``transformers``' ``GptOssExperts`` computes it: ``gate`` clamped
  above at ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) * (gate * sigmoid(gate * alpha))`` (OpenAI 2025,
  "gpt-oss-120b & gpt-oss-20b model card", section 2.1).

Bits: clamps, adds and multiplies are single rounded operations, the same for an element wherever it sits; PyTorch's
``sigmoid`` and ``silu`` are not (their vectorized loop and their scalar tail round differently, and where a tail
falls depends on the tensor's length and on how its threads split it), so ``rowwise`` runs them on row blocks small
enough for one thread, each block a whole number of vector steps (or one row): an element's bits then depend on its
column alone, not on which or how many rows share the call, nor on the thread count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Expert activations (see the module docstring).
ACTIVATIONS = ("silu", "swiglu_oai")

#: Elements below which PyTorch runs an element-wise op on the calling thread (``at::internal::GRAIN_SIZE``).
_SERIAL = 32768
#: A width whose rows PyTorch's float32 loops run whole in vector steps (two 16-lane AVX-512 vectors a step; AVX2's
#: 16-element steps divide it).
_VECTOR_STEP = 32


def rowwise(fn, z: torch.Tensor) -> torch.Tensor:
    """``fn(z)`` for an element-wise PyTorch op ``fn`` on float32 ``z [T, I]`` (any row stride, unit column stride)
    -> ``[T, I]`` contiguous, each element's bits depending on its column only (module docstring): ``fn`` over blocks
    of rows under ``_SERIAL`` elements when ``I`` is a multiple of ``_VECTOR_STEP`` (every element on the vector
    loop), else over one row a call (the same tail columns in every row)."""
    t, i = z.shape
    rows = max(1, _SERIAL // max(i, 1)) if i % _VECTOR_STEP == 0 else 1
    if rows >= t:
        return fn(z).contiguous()
    out = torch.empty(t, i, dtype=z.dtype)
    for r in range(0, t, rows):
        out[r: r + rows] = fn(z[r: r + rows])
    return out


def expert_activation(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The expert's gated activation: ``h [T, 2I]`` float32 (gate columns, then up) -> ``[T, I]`` float32
    contiguous; ``alpha`` and ``limit`` are ``"swiglu_oai"``'s (gpt-oss: 1.702 and 7.0).

    Raises:
        ValueError: an activation not in ``ACTIVATIONS``."""
    i = h.shape[1] // 2
    gate, up = h[:, :i], h[:, i:]
    if activation == "silu":
        return rowwise(F.silu, gate) * up
    if activation != "swiglu_oai":
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * rowwise(torch.sigmoid, gate * alpha))
