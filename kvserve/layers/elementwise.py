"""Element-wise layers of a decoder: RMSNorm, the residual add fused with the next RMSNorm, and SwiGLU's
``silu(gate) * up``.

Two implementations of the same ops, one chosen at start-up: PyTorch's (any device and dtype) and kvserve's
one-pass CPU kernels (``csrc/elementwise.c``: PyTorch runs five ops for RMSNorm, one more for the add before it, and
two for silu * up), which fall back to PyTorch per call when a tensor does not fit them (dtype, layout, width not a
multiple of 8 or 16). Both compute the same float32 values (the kernels round each operation as PyTorch does).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu as cpu_kernels


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

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next norm of a decoder layer: ``h + delta`` and its ``rms_norm``.

        Args:
            h: ``[T, H]``, the residual stream; may be updated in place (the kernel version does), so pass a
                tensor nothing else reads.
            delta: ``[T, H]``, the sub-layer's output.
            weight: ``[H]``; eps: as ``rms_norm``.
            out: a ``[T, H]`` buffer the norm may be written into (the kernel version does, when it fits);
                ``None``: a new tensor.

        Returns:
            ``(h + delta, rms_norm(h + delta, weight))``, both ``[T, H]``.
        """
        h = h + delta
        return h, self.rms_norm(h, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) -> ``[T, I]``; ``out``: a ``[T, I]`` buffer the
        result may be written into (the kernel version does, when it fits), ``None``: a new tensor."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def act_mul(self, gate_up: torch.Tensor, act: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gated MLP's ``act(gate) * up`` (``silu_mul`` for ``"silu"``; GEGLU, Shazeer 2020, for ``"gelu"``
        (exact, erf) and ``"gelu_pytorch_tanh"`` / ``"gelu_new"`` (the tanh approximation)); shapes as
        ``silu_mul``."""
        if act == "silu":
            return self.silu_mul(gate_up, out)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="none" if act == "gelu" else "tanh") * up


class CPUKernelOps(TorchOps):
    """The same ops through ``csrc/elementwise.c`` (float32 CPU; use only when ``cpu_kernels.load()`` succeeded)."""

    name = "cpu-kernels"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = cpu_kernels.rms_norm(x, weight, eps) if x.dtype == torch.float32 else None
        return y if y is not None else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        y = cpu_kernels.add_rms_norm(h, delta, weight, eps, out)
        return (h, y) if y is not None else super().add_rms_norm(h, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = cpu_kernels.silu_mul(gate_up, out)
        return y if y is not None else super().silu_mul(gate_up)
