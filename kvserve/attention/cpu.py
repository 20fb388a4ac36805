"""The CPU-kernel backend: every query -- decode tokens, verification spans, prompt chunks of any length, the tails
of prefix-cache hits -- attended by one kernel that reads K/V in place through the block table.

``csrc/paged_attention.c`` (through ``kvserve.kernels.cpu``) splits a step's attention into tasks of (request, KV
head, block of query rows), spread over the threads; each task transposes its key tiles once and computes its rows'
scores, softmaxes and weighted sums in register tiles (timings: docs/performance.md, "Batch invariance"). Per
layer, ``forward_qkv`` is one kernel call for RoPE, the K/V write and the attention of every request (the reference
path runs about a dozen PyTorch ops for the same).

Batch invariance, always on: the kernel's arithmetic for one query row is a fixed sequence of float operations on
that row's query and the keys and values up to its position (keys summed in position order, whatever the tiling,
the tasks or the threads). With the row-wise quantized matmuls, norms and RoPE, a token's logits are then
bit-identical whether its prompt ran in one step or in chunks, after a prefix-cache hit, after a preemption or beside
other requests. The kernel is as fast as the gather + SDPA path it replaced on long prompts (docs/performance.md,
"Batch invariance"), so no switch turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.attention.base import check_mask
from kvserve.attention.torch_sdpa import AttentionMetadata, TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from kvserve.batch import InputBatch


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    """One step's attention plan for the CPU kernel (``groups`` is empty: every request goes to the kernel).

    Attributes:
        kernel: the step's requests, read in place by the kernel:
            ``(block_tables [b, max_blocks], q_start [b], q_len [b], seq_len [b])`` int64 contiguous.
        fused: ``(num_heads, scale, kv dtype, sliding window, soft-cap, sinks or not) -> (rope,
            cpu_kernels.RopeWriteAttend)``:
            the kernel's arguments that are the same for every layer of the step with those settings (a model with
            local and global layers has two), resolved by the first such ``forward_qkv`` and reused by the others.
    """

    kernel: Optional[tuple] = None
    fused: dict = field(default_factory=dict)


class CPUKernelAttentionBackend(TorchSDPABackend):
    """float32 queries on the CPU, over a float32, bfloat16 or int8 KV cache (``kv_cache_dtype``); use when
    ``cpu_kernels.load()`` returned the library (``select_attention_backend``). Models whose head width the
    kernel's build does not take get the next build down (AMX and AVX-512: ``D`` a multiple of 16, AVX2: 8) or the
    reference backend (``for_head_dim``), once; a call the kernel refuses after that is an error, never a silent
    fallback."""

    name = "cpu-kernels"

    def __init__(self, isa: str = "avx2"):
        """``isa``: the kernel's build, a key of ``cpu_kernels.ATTENTION_ISAS`` this CPU runs
        (``cpu_kernels.attention_isa``)."""
        if isa not in cpu_kernels.ATTENTION_ISAS:
            raise ValueError(f"isa must be one of {sorted(cpu_kernels.ATTENTION_ISAS)}, got {isa!r}")
        self.isa = isa

    def for_head_dim(self, head_dim: int):
        chain = ("amx", "avx512", "avx2")  # each build runs where the one before it does
        for isa in chain[chain.index(self.isa):]:
            if head_dim % cpu_kernels.ATTENTION_ISAS[isa] == 0:
                return self if isa == self.isa else CPUKernelAttentionBackend(isa)
        return TorchSDPABackend()

    def build_metadata(self, batch: InputBatch) -> CPUAttentionMetadata:
        qsl = batch.query_start_loc
        kernel = (batch.block_tables.contiguous(), qsl[:-1], qsl[1:] - qsl[:-1], batch.seq_lens)
        return CPUAttentionMetadata(groups=[], kernel=kernel, whole_step_in_kernel=True)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CPUAttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_mask(sliding_window, logit_softcap)
        out = torch.empty_like(q)
        if not cpu_kernels.paged_attention(q, kv_cache, *meta.kernel, scale, out, self.isa, sliding_window,
                                           logit_softcap, sinks):
            raise RuntimeError(f"the paged-attention kernel refused q {list(q.shape)} {q.dtype} over a "
                               f"{kv_cache.dtype} cache, or could not allocate its scratch memory")
        return out

    def forward_qkv(self, qkv: torch.Tensor, num_heads: int, kv_cache: torch.Tensor, meta: CPUAttentionMetadata,
                    rope: tuple[torch.Tensor, torch.Tensor], batch: InputBatch, scale: float,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        key = (num_heads, scale, kv_cache.dtype, sliding_window, logit_softcap, sinks is not None)
        fused = meta.fused.get(key)
        if fused is None or fused[0] is not rope:
            check_mask(sliding_window, logit_softcap)
            plan = cpu_kernels.RopeWriteAttend(num_heads, kv_cache.shape, kv_cache.dtype, *rope, batch.slot_mapping,
                                               meta.kernel, scale, self.isa, sliding_window, logit_softcap,
                                               sinks is not None)
            fused = meta.fused[key] = (rope, plan)
        res = fused[1](qkv, kv_cache, out, sinks)
        if res is None:
            raise ValueError(f"the fused attention kernel cannot take qkv {list(qkv.shape)} {qkv.dtype} over a "
                             f"{list(kv_cache.shape)} {kv_cache.dtype} cache (head width not a multiple of "
                             f"{cpu_kernels.ATTENTION_ISAS[self.isa]}, or another dtype, or sinks not [H_q] float32: "
                             f"such a model gets another backend, for_head_dim)")
        out, done = res
        if not done:
            raise MemoryError("the fused attention kernel could not allocate its scratch memory")
        return out
