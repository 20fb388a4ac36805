"""Dense projections ``y = x @ W.T`` on the CPU: oneDNN with pre-packed weights, else MKL.

On this project's CPUs (2-core AMD EPYC, AVX2) the matmuls are most of a step. Measured side by side on the
model's shapes, oneDNN with a weight re-laid-out once at load time ("packed", as PyTorch's own CPU inference
freezing does) beats MKL's ``sgemm`` on the same tensors: the 49152 x 576 LM head at 1 row 5.7 vs 10.5 ms, at 16
rows 16.8 vs 23.4 ms; the 3072 x 576 MLP projection at 1 row 0.25 vs 0.54 ms; 512-row prefill chunks 5-20% faster.
Packing needs a float32 CPU build of PyTorch with oneDNN (``torch.backends.mkldnn``); anything else (bfloat16, a
build without it, a numerical self-check that fails) uses ``(W @ x.T).T`` on MKL, which on these CPUs is 1.5-4x
faster than ``F.linear`` for the skinny ``x`` of decode steps.
"""

from __future__ import annotations

import torch

# Batch-size hint for oneDNN's weight layout; the packed weight works for any number of rows.
_PACK_HINT_ROWS = 16


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """A bias-free linear layer.

    Args:
        weight: ``[out_features, in_features]``. When packed for oneDNN the packed copy replaces it (same size);
            ``weight`` then stays reachable only through the caller's own references.
        pack: try the oneDNN packed path (default). It is used only if a self-check on random input matches
            MKL to 1e-4 relative.

    Call with ``x [T, in_features]`` (contiguous, same dtype) -> ``[T, out_features]``.
    """

    def __init__(self, weight: torch.Tensor, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.packed = None
        self.weight = weight
        if pack and _can_pack(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
                x = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0))
                ref = torch.mm(weight, x.t()).t()
                got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                if torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())):
                    self.packed, self.weight = packed, None
            except (RuntimeError, AttributeError):  # an op missing from this build: stay on MKL
                pass

    def numel(self) -> int:
        """Weights (= multiply-adds per row): ``out_features * in_features``."""
        return self.out_features * self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return torch.mm(self.weight, x.t()).t().contiguous()
