"""Attention backends (``base.AttentionBackend``): the reference gather + SDPA one and kvserve's CPU kernels."""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend


def select_attention_backend(device: str, dtype: torch.dtype, cpu_kernels_available: bool,
                             cpu_isa: str = "auto") -> AttentionBackend:
    """The backend for this device and dtype, chosen once at start-up: the in-place CPU kernel for float32 on a
    CPU where it was built (its AVX2, AVX-512 or AMX build: ``cpu_kernels.attention_isa(cpu_isa)``), else gather +
    SDPA.
    Only the first is batch-invariant (``kvserve.attention.cpu``)."""
    if device == "cpu" and dtype == torch.float32 and cpu_kernels_available:
        from kvserve.attention.cpu import CPUKernelAttentionBackend
        from kvserve.kernels import cpu as cpu_kernels

        return CPUKernelAttentionBackend(cpu_kernels.attention_isa(cpu_isa))
    return TorchSDPABackend()


__all__ = ["AttentionBackend", "TorchSDPABackend", "select_attention_backend"]
