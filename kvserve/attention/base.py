"""The attention backend interface: what a model's attention layers call, whatever runs underneath.

Three operations (mini-sglang's ``attention/base.py`` and vLLM's ``AttentionBackend`` have the same shape): build
the step's metadata once from the flat batch, write each layer's new K/V into the paged cache, and attend; plus
``forward_qkv``, which a model calls once per layer for all of it after its fused Q/K/V projection (RoPE, the K/V
write, attention), so a backend can do the whole layer in one kernel call. The batch is passed explicitly; there is
no global forward context. A backend is chosen once at start-up
(``kvserve.attention.select_attention_backend``).
"""

from __future__ import annotations

import abc
from typing import Optional

import torch

from kvserve.attention.kv_layout import from_float, head_dim
from kvserve.layers.rotary import apply_rotary
from kvserve.batch import InputBatch


def check_mask(sliding_window: Optional[int], logit_softcap: Optional[float]) -> None:
    """Raise ``ValueError`` unless ``sliding_window`` is ``None`` or a positive int and ``logit_softcap`` ``None`` or
    a positive float (``AttentionBackend.forward``'s arguments)."""
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be a positive float or None, got {logit_softcap!r}")


class AttentionBackend(abc.ABC):
    """Paged attention over a flat token batch (PagedAttention, Kwon et al., SOSP 2023, §4.1).

    The KV cache of one layer is ``kv_cache[2, num_blocks, block_size, H_kv, D]`` (K at 0, V at 1; an int8 cache's
    rows are ``D + 2`` bytes, values then scale: ``kv_layout``); token ``t`` of
    the batch writes its K/V to slot ``slot_mapping[t]``.

    Attributes:
        name: short name for the start-up log line.
    """

    name: str = "abstract"

    def for_head_dim(self, head_dim: int) -> "AttentionBackend":
        """The backend a model with heads of ``head_dim`` uses, decided once when the model is built: this one,
        or (a backend whose kernels cannot take that width) the reference backend."""
        return self

    @abc.abstractmethod
    def build_metadata(self, batch: InputBatch) -> object:
        """Everything every layer's ``forward`` needs for this step, built once per step: it decides what runs
        (which requests go to which kernel)."""

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: InputBatch) -> None:
        """Scatter this step's keys and values into their slots.

        Args:
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, one layer (int8: ``D + 2``, ``kv_layout``).
            k, v: ``[T, H_kv, D]``, converted to the cache's dtype if they differ (``kv_cache_dtype``: e.g. float32
                values rounded to a bfloat16 cache, or quantized per head to an int8 one: ``kv_layout.from_float``).
            batch: the step's ``InputBatch`` (its ``slot_mapping``).
        """
        h, row = kv_cache.shape[-2:]
        kv_cache[0].view(-1, h, row).index_copy_(0, batch.slot_mapping, from_float(k, kv_cache.dtype))
        kv_cache[1].view(-1, h, row).index_copy_(0, batch.slot_mapping, from_float(v, kv_cache.dtype))

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: object, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of the batch's queries over each request's paged K/V (this step's already written).

        Args:
            q: ``[T, H_q, D]``; ``H_q`` a multiple of ``H_kv`` (GQA).
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, one layer (its dtype may differ from ``q``'s:
                keys and values are widened, or dequantized, to ``q``'s dtype as they are read; int8: ``D + 2``).
            meta: what ``build_metadata`` returned for this step.
            scale: softmax scale, usually ``D ** -0.5``.
            sliding_window: the layer's window in tokens: the query at position ``p`` sees only the keys ``j`` with
                ``p - sliding_window < j <= p`` (Hugging Face's ``sliding_window``; Mistral, Gemma); ``None``: all
                keys up to ``p``.
            logit_softcap: each score ``s`` (after ``scale``) becomes ``logit_softcap * tanh(s / logit_softcap)``
                before the masked softmax (Gemma 2's ``attn_logit_softcapping``); ``None``: no capping.
            sinks: ``[H_q]`` float32, each query head's attention-sink logit: one more term in every row's softmax
                denominator (and its maximum) that weighs no value (gpt-oss; ``transformers``'
                ``GptOssAttention.sinks``); ``None``: none.

        Returns:
            ``[T, H_q, D]``, the dtype of ``q``. Query ``i`` of a request with ``q_len`` queries and ``seq_len``
            keys sits at position ``seq_len - q_len + i`` and sees keys ``0 ..`` that position (those of its
            window).

        Raises:
            ValueError: ``sliding_window < 1`` or ``logit_softcap <= 0``.
        """

    def forward_qkv(self, qkv: torch.Tensor, num_heads: int, kv_cache: torch.Tensor, meta: object,
                    rope: tuple[torch.Tensor, torch.Tensor], batch: InputBatch, scale: float,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's attention from its fused Q/K/V projection: RoPE on the queries and keys, ``write_kv``, then
        ``forward``. This default runs them as PyTorch ops; a backend may fuse them.

        Args:
            qkv: ``[T, (H_q + 2 H_kv) * D]``: per row ``H_q`` query heads, then ``H_kv`` key and ``H_kv`` value
                heads of ``D``. A backend may overwrite it (e.g. rotate it in place): the caller must not reuse it.
            num_heads: ``H_q``.
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, one layer.
            meta: what ``build_metadata`` returned for this step.
            rope: ``(cos, sin)``, each ``[T, 1, D]`` contiguous (``kvserve.layers.rotary.rope_cos_sin``).
            batch: the step's ``InputBatch``.
            scale: softmax scale.
            out: a ``[T, H_q * D]`` buffer the result may be written into (a backend that can, does); ``None``: a
                new tensor.
            sliding_window, logit_softcap, sinks: the layer's mask, score cap and sinks, as ``forward``'s.

        Returns:
            ``[T, H_q * D]``, as ``forward``'s output with the heads flattened.
        """
        h_kv, d = kv_cache.shape[-2], head_dim(kv_cache)
        qk = apply_rotary(qkv[:, : (num_heads + h_kv) * d].view(-1, num_heads + h_kv, d), *rope)  # q and k at once
        self.write_kv(kv_cache, qk[:, num_heads:], qkv[:, (num_heads + h_kv) * d :].view(-1, h_kv, d), batch)
        return self.forward(qk[:, :num_heads], kv_cache, meta, scale, sliding_window, logit_softcap,
                            sinks).reshape(-1, num_heads * d)
