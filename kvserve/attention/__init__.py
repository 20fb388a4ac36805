"""Attention backends (``base.AttentionBackend``): the reference gather + SDPA one and kvserve's CPU kernels."""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend


def select_attention_backend(device: str, dtype: torch.dtype, cpu_kernels_available: bool,
                             batch_invariant: bool = False) -> AttentionBackend:
    """The backend for this device and dtype, chosen once at start-up: the in-place CPU kernels for float32 on a
    CPU where they were built (``batch_invariant``: every query through the kernel), else gather + SDPA."""
    if device == "cpu" and dtype == torch.float32 and cpu_kernels_available:
        from kvserve.attention.cpu import CPUKernelAttentionBackend

        return CPUKernelAttentionBackend(batch_invariant)
    return TorchSDPABackend()


__all__ = ["AttentionBackend", "TorchSDPABackend", "select_attention_backend"]
