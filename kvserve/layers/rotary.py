"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), rotate-half form as in Hugging Face's Llama
(``apply_rotary_pos_emb``): the cos/sin rows of a step's positions, and their application with PyTorch ops.

kvserve's CPU attention backend applies the same rotation inside its fused attention call
(``csrc/paged_attention.c``, ``kvserve_rope_write_attend_f32``) with the same rounding, so both give equal bits.
"""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``[D / 2]`` float32 inverse frequencies ``theta ** (-2i / D)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles: ``positions [T]`` int -> two ``[T, 1, D]`` tensors of ``dtype``
    (contiguous; the two halves of each row are equal), broadcastable over heads."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class RopeTable:
    """``rope_cos_sin`` of positions ``0 .. n-1`` computed once and indexed per step (two index ops instead of six
    element-wise ones: a batch-1 decode step is a few milliseconds, and those ops were ~0.1 ms of it). The rows are
    the same bits as ``rope_cos_sin`` of the step's positions (element-wise ops: the value at a position does not
    depend on the others; ``tests/model/test_rotary.py``). The table grows by doubling when a step reaches past it
    (float32, 64-dim heads: 512 bytes per position).

    Args:
        inv_freq: ``[D / 2]`` float32 (``rope_inv_freq``).
        dtype: of the returned rows.
    """

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq, dtype
        self.cos = self.sin = torch.empty(0, inv_freq.shape[0] * 2, dtype=dtype)

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64, all below ``end`` -> ``(cos, sin)``, each ``[T, 1, D]`` contiguous."""
        if end > self.cos.shape[0]:
            n = max(end, 2 * self.cos.shape[0], 256)
            cos, sin = rope_cos_sin(torch.arange(n), self.inv_freq, self.dtype)
            self.cos, self.sin = cos[:, 0], sin[:, 0]
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated: ``x * cos + rotate_half(x) * sin`` with ``cos``, ``sin`` from ``rope_cos_sin``
    (a new tensor)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
