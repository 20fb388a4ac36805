"""The CPU-kernel backend: decode tokens and short queries read K/V in place through the block table.

``csrc/paged_attention.c`` (through ``kvserve.model.cpu_kernels``) runs one task per (request, KV head) serving all
its GQA query heads, reading each block where it lies; the gather of the reference backend copies every key and
value of the group once more per layer (sizes and timings: docs/benchmarks.md, "CPU kernels"). Long prompt chunks
keep the gather + SDPA path.
"""

from __future__ import annotations

import torch

from kvserve.attention.torch_sdpa import SHORT_QUERY_TOKENS, AttentionGroup, TorchSDPABackend
from kvserve.model import cpu_kernels


class CPUKernelAttentionBackend(TorchSDPABackend):
    """float32 CPU only; use when ``cpu_kernels.load()`` returned the library (``select_attention_backend``)."""

    name = "cpu-kernels"

    def _forward_group_in_place(self, q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float,
                                out: torch.Tensor) -> bool:
        b, q_max = group.query_index.shape
        return q_max <= SHORT_QUERY_TOKENS and cpu_kernels.paged_attention(
            q, kv_cache, group.block_tables.view(b, -1), group.q_start, group.q_len, group.seq_len, scale, out)
