"""The attention backend interface: what a model's attention layers call, whatever runs underneath.

Three operations (mini-sglang's ``attention/base.py`` and vLLM's ``AttentionBackend`` have the same shape): build
the step's metadata once from the flat batch, write each layer's new K/V into the paged cache, and attend. The
batch is passed explicitly; there is no global forward context. A backend is chosen once at start-up
(``kvserve.attention.select_attention_backend``).
"""

from __future__ import annotations

import abc

import torch

from kvserve.worker.input_batch import InputBatch


class AttentionBackend(abc.ABC):
    """Paged attention over a flat token batch (PagedAttention, Kwon et al., SOSP 2023, §4.1).

    The KV cache of one layer is ``kv_cache[2, num_blocks, block_size, H_kv, D]`` (K at 0, V at 1); token ``t`` of
    the batch writes its K/V to slot ``slot_mapping[t]``.

    Attributes:
        name: short name for the start-up log line.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def build_metadata(self, batch: InputBatch) -> object:
        """Everything every layer's ``forward`` needs for this step, built once per step."""

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: InputBatch) -> None:
        """Scatter this step's keys and values into their slots.

        Args:
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, one layer.
            k, v: ``[T, H_kv, D]``, same dtype as the cache.
            batch: the step's ``InputBatch`` (its ``slot_mapping``).
        """
        h, d = kv_cache.shape[-2:]
        kv_cache[0].view(-1, h, d).index_copy_(0, batch.slot_mapping, k)
        kv_cache[1].view(-1, h, d).index_copy_(0, batch.slot_mapping, v)

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: object, scale: float) -> torch.Tensor:
        """Causal attention of the batch's queries over each request's paged K/V (this step's already written).

        Args:
            q: ``[T, H_q, D]``; ``H_q`` a multiple of ``H_kv`` (GQA).
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, one layer.
            meta: what ``build_metadata`` returned for this step.
            scale: softmax scale, usually ``D ** -0.5``.

        Returns:
            ``[T, H_q, D]``, the dtype of ``q``. Query ``i`` of a request with ``q_len`` queries and ``seq_len``
            keys sits at position ``seq_len - q_len + i`` and sees keys ``0 ..`` that position.
        """
