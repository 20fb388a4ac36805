"""Element-wise layers of a decoder: RMSNorm and SwiGLU's ``silu(gate) * up``.

Two implementations of the same two ops, one chosen at start-up: PyTorch's (any device and dtype) and kvserve's
one-pass CPU kernels (``csrc/elementwise.c``: PyTorch runs five ops for RMSNorm and two for silu * up), which fall
back to PyTorch per call when a tensor does not fit them (dtype, layout, width not a multiple of 8 or 16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels


class TorchOps:
    """RMSNorm (Zhang & Sennrich 2019) and SwiGLU (Shazeer 2020) with PyTorch ops."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` computed in float32; ``x [T, H]``, ``weight [H]`` -> ``[T, H]`` in ``x``'s dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) -> ``[T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CPUKernelOps(TorchOps):
    """The same ops through ``csrc/elementwise.c`` (float32 CPU; use only when ``cpu_kernels.load()`` succeeded)."""

    name = "cpu-kernels"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = cpu_kernels.rms_norm(x, weight, eps) if x.dtype == torch.float32 else None
        return y if y is not None else super().rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        y = cpu_kernels.silu_mul(gate_up) if gate_up.dtype == torch.float32 else None
        return y if y is not None else super().silu_mul(gate_up)
