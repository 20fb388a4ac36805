"""Linear methods: how a projection ``y = x @ W.T`` is stored and computed, chosen once per weight at load.

Every method offers the same call, ``method(x [T, in_features]) -> [T, out_features]``, plus ``numel()`` (weights
= multiply-adds per row), ``out_features``, ``in_features`` and ``path`` (which implementation runs), so the model
never asks how a weight is stored. ``Linear`` is the dense one; its paths, fastest that passes a self-check first:

1. ``kvserve`` (float32 CPU): kvserve's AVX2 kernel (``csrc/gemm_avx2.c``), weights packed into 16-feature panels.
2. ``onednn``: oneDNN with a weight re-laid-out once at load ("packed", as PyTorch's CPU inference freezing does),
   when the kernel cannot be built here (no AVX2, no C compiler) and PyTorch has oneDNN.
3. ``mkl``: ``(W @ x.T).T`` otherwise (bfloat16, ``pack=False``, other devices), faster than ``F.linear`` for skinny
   ``x`` on a CPU.

Measured side by side on this model's shapes: docs/benchmarks.md ("CPU kernels").
"""

from __future__ import annotations

import torch

from typing import Protocol

from kvserve.model import cpu_kernels


class LinearMethod(Protocol):
    """What the model calls: ``method(x [T, in_features]) -> [T, out_features]`` in the activation dtype."""

    out_features: int
    in_features: int
    path: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...

# Batch-size hint for oneDNN's weight layout; the packed weight works for any number of rows.
_PACK_HINT_ROWS = 16


def _onednn_ok(weight: torch.Tensor) -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear:
    """A bias-free linear layer.

    Args:
        weight: ``[out_features, in_features]``. When packed, the packed copy replaces it (same size, plus at most
            15 zero rows); ``weight`` then stays reachable only through the caller's own references.
        pack: try the packed paths (default; only float32 CPU weights are packed). A packed path is used only if a self-check on random input (1, 7 and
            19 rows: full and partial register blocks) matches MKL to 1e-4 relative.
        use_kernels: allow kvserve's own kernel (the backend selection passes ``False`` when it is off).

    Attributes:
        path: ``"kvserve"``, ``"onednn"`` or ``"mkl"``, the path in use.

    Call with ``x [T, in_features]`` (same dtype) -> ``[T, out_features]``.
    """

    def __init__(self, weight: torch.Tensor, pack: bool = True, use_kernels: bool = True):
        self.out_features, self.in_features = weight.shape
        self.packed, self.path, self.weight = None, "mkl", weight
        if not (pack and weight.dtype == torch.float32 and weight.device.type == "cpu"):
            return
        candidates = []
        if use_kernels and cpu_kernels.load() is not None:
            candidates.append(("kvserve", cpu_kernels.pack))
        if _onednn_ok(weight):
            candidates.append(("onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)))
        g = torch.Generator().manual_seed(0)
        for path, make in candidates:
            try:
                self.packed, self.path = make(weight), path
                ok = True
                for rows in (1, 7, 19):
                    x = torch.randn(rows, self.in_features, generator=g)
                    ref = torch.mm(weight, x.t()).t()
                    ok = ok and torch.allclose(self(x), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
                if ok:
                    self.weight = None
                    return
            except (RuntimeError, AttributeError):  # an op missing from this build: try the next path
                pass
        self.packed, self.path = None, "mkl"

    def numel(self) -> int:
        """Weights (= multiply-adds per row): ``out_features * in_features``."""
        return self.out_features * self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "kvserve":
            return cpu_kernels.gemm(x, self.packed, self.out_features)
        if self.path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return torch.mm(self.weight, x.t()).t().contiguous()
