"""The CPU-kernel backend: decode tokens and short queries read K/V in place through the block table.

``csrc/paged_attention.c`` (through ``kvserve.kernels.cpu``) runs one task per request serving all its GQA
query heads (with fewer than two requests per thread and enough work, ``SPREAD_MIN_MACS``, each request's scores,
softmaxes and weighted sums are split over the threads instead, with the same arithmetic), reading each block
where it lies; the gather of the reference backend copies every key and value of the group once more per layer
(sizes and timings: docs/performance.md, "CPU kernels"). Per layer, ``forward_qkv`` is one kernel call for RoPE, the
K/V write and the in-place attention of every query of at most ``SHORT_QUERY_TOKENS`` tokens (the reference path
runs about a dozen PyTorch ops for the same: docs/performance.md, "The rest of the decode step"). Long prompt
chunks keep the gather + SDPA path, on the queries the kernel rotated.

Batch invariance (the engine argument ``batch_invariant``, after vLLM's ``VLLM_BATCH_INVARIANT``): every query, however long
its chunk, goes through the kernel, whose arithmetic for one query row does not depend on the other rows of the
step (keys summed in position order, however the work is split over threads). With the row-wise quantized matmuls,
norms and RoPE, a token's logits are then bit-identical whether its prompt ran in one step or in chunks, after a
prefix-cache hit or beside other requests. By default long chunks use SDPA instead (faster prefill; measured
in docs/performance.md, "Batch invariance"), whose float summation order differs from the kernel's by ~1e-7 — differences that int8 activation
rounding can amplify to a different greedy token on the quantized path.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.attention.torch_sdpa import (SHORT_QUERY_TOKENS, AttentionMetadata, TorchSDPABackend, build_group,
                                          sdpa_group)
from kvserve.kernels import cpu as cpu_kernels
from kvserve.batch import InputBatch


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    """One step's attention plan for the CPU kernels.

    Attributes:
        groups: the gather + SDPA groups: only the prefill requests (longer than ``SHORT_QUERY_TOKENS``; none
            under batch invariance).
        kernel: the requests of at most ``SHORT_QUERY_TOKENS`` query tokens (all under batch invariance), read in
            place by the kernel:
            ``(block_tables [b, max_blocks], q_start [b], q_len [b], seq_len [b])`` int64 contiguous; ``None`` when
            there are none.
        kernel_members: their indices among the batch's requests.
        fused: ``(rope, num_heads, scale, cpu_kernels.RopeWriteAttend)``: the kernel's arguments that are the same
            for every layer of the step, resolved by its first ``forward_qkv`` and reused by the others.
    """

    kernel: Optional[tuple] = None
    kernel_members: tuple = ()
    fused: Optional[tuple] = None


class CPUKernelAttentionBackend(TorchSDPABackend):
    """float32 queries on the CPU, over a float32 or bfloat16 KV cache (``kv_cache_dtype``); use when
    ``cpu_kernels.load()`` returned the library (``select_attention_backend``). Models whose head width the
    kernels do not take (not a multiple of 8) get the reference backend instead (``for_head_dim``), once; a call
    the kernel refuses after that is an error, never a silent fallback."""

    name = "cpu-kernels"

    def __init__(self, batch_invariant: bool = False):
        """``batch_invariant``: every query through the kernel (see the module docstring)."""
        self.batch_invariant = batch_invariant
        self.kernel_query_tokens = sys.maxsize if batch_invariant else SHORT_QUERY_TOKENS

    def for_head_dim(self, head_dim: int):
        return self if head_dim % 8 == 0 else TorchSDPABackend()

    def build_metadata(self, batch: InputBatch) -> CPUAttentionMetadata:
        q_lens, limit = batch.query_lens, self.kernel_query_tokens
        short = [b for b, q in enumerate(q_lens) if q <= limit]
        prefill = [b for b, q in enumerate(q_lens) if q > limit]
        kernel = None
        if len(short) == len(q_lens):  # every request (a decode step): the batch's own tensors
            qsl = batch.query_start_loc
            kernel = (batch.block_tables.contiguous(), qsl[:-1], qsl[1:] - qsl[:-1], batch.seq_lens)
        elif short:
            idx = torch.tensor(short)
            kernel = (batch.block_tables[idx], batch.query_start_loc[idx],
                      torch.tensor([q_lens[b] for b in short]), batch.seq_lens[idx])
        return CPUAttentionMetadata(groups=[build_group(prefill, batch)] if prefill else [], kernel=kernel,
                                    kernel_members=tuple(short), whole_step_in_kernel=not prefill)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CPUAttentionMetadata,
                scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.kernel is not None and not cpu_kernels.paged_attention(q, kv_cache, *meta.kernel, scale, out):
            raise RuntimeError(f"the paged-attention kernel refused q {list(q.shape)} {q.dtype} over a "
                               f"{kv_cache.dtype} cache, or could not allocate its scratch memory")
        for g in meta.groups:
            sdpa_group(q, kv_cache, g, scale, out)
        return out

    def forward_qkv(self, qkv: torch.Tensor, num_heads: int, kv_cache: torch.Tensor, meta: CPUAttentionMetadata,
                    rope: tuple[torch.Tensor, torch.Tensor], batch: InputBatch, scale: float,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        fused = meta.fused
        if (fused is None or fused[0] is not rope or fused[1] != num_heads or fused[2] != scale
                or fused[3].kv_dtype != kv_cache.dtype):
            plan = cpu_kernels.RopeWriteAttend(num_heads, kv_cache.shape, kv_cache.dtype, *rope, batch.slot_mapping,
                                               meta.kernel, scale)
            fused = meta.fused = (rope, num_heads, scale, plan)
        res = fused[3](qkv, kv_cache, out)
        if res is None:
            raise ValueError(f"the fused attention kernel cannot take qkv {list(qkv.shape)} {qkv.dtype} over a "
                             f"{list(kv_cache.shape)} {kv_cache.dtype} cache (head width not a multiple of 8, or "
                             f"another dtype: such a model gets the reference backend, for_head_dim)")
        out, done = res
        if not done:
            raise MemoryError("the fused attention kernel could not allocate its scratch memory")
        if meta.groups:  # long chunks: queries and keys are rotated in place in qkv, and the K/V written
            d = kv_cache.shape[-1]
            q, o = qkv[:, : num_heads * d].view(-1, num_heads, d), out.view(-1, num_heads, d)
            for g in meta.groups:
                sdpa_group(q, kv_cache, g, scale, o)
        return out
