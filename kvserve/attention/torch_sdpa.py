"""The device-agnostic reference backend: gather each request's blocks, then PyTorch's SDPA.

Requests are split into at most three groups per step, built once in ``build_metadata``: decode requests (one
query token each), short queries (2..``SHORT_QUERY_TOKENS`` tokens: speculative verification spans, short chunks)
and prefill requests (a prompt or chunk), each padded to its group's longest. Each group is one
``scaled_dot_product_attention`` call per layer, so no Python loop runs over requests inside a layer, and a long
prompt in the batch does not pad every decode or verifying request to its length. A group's K/V is gathered
through its block tables into a padded copy first (``index_select`` over whole blocks); the CPU-kernel backend
(``kvserve.attention.cpu``) reads the decode and short queries in place instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, check_mask
from kvserve.attention.kv_layout import to_float
from kvserve.batch import InputBatch

# Queries of at most this many tokens (speculative verification spans: last token + drafts, short prompt tails)
# form their own group, so they are not padded to the length of a long prompt chunk in the same step.
SHORT_QUERY_TOKENS = 32


@dataclass
class AttentionGroup:
    """Requests attended together (one SDPA call).

    Attributes:
        query_index: ``[b, q_max]`` int64, flat-batch index of each (padded) query row (padding points at row 0).
        query_valid: ``[b * q_max]`` bool, which padded rows are real tokens.
        out_index: ``[n_real]`` int64, flat-batch index of each real row, in padded order.
        block_tables: ``[b * n_blocks]`` int64, each member's physical block ids in logical order, flattened
            (padding with block 0).
        attn_mask: ``[b, 1, q_max, n_blocks * block_size]`` bool, True where query i may attend key j.
        rows: ``(start, stop)`` when the group's queries are exactly flat rows ``start..stop-1`` in order with no
            padding (e.g. the decode group, scheduled first): then they are read and written as a slice, without
            gather/scatter copies; else ``None``.
        is_causal: every member is a whole fresh prompt (no earlier context), so the mask is plain top-left
            causal and SDPA can use ``is_causal=True`` (its kernel then skips the masked half) instead of
            ``attn_mask`` (without a sliding window).
        q_pos: ``[b, q_max]`` int64, each (padded) query row's position.
        window_masks: sliding window -> ``attn_mask`` with that window applied (``window_mask``), built by the
            first layer that uses it and reused by the others.
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor
    out_index: torch.Tensor
    block_tables: torch.Tensor
    attn_mask: torch.Tensor
    rows: Optional[tuple] = None
    is_causal: bool = False
    q_pos: Optional[torch.Tensor] = None
    window_masks: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, used by every layer.

    Attributes:
        groups: up to three ``AttentionGroup`` objects (decode, short, prefill), the ones with members.
        whole_step_in_kernel: every request of the step is attended by kvserve's paged-attention kernel (decided
            by the CPU backend's ``build_metadata``): a fused layer loop may then run the step.
    """

    groups: list[AttentionGroup]
    whole_step_in_kernel: bool = False


def split_requests(query_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Request indices of the decode (1 query token), short (2..``SHORT_QUERY_TOKENS``) and prefill groups."""
    decode = [b for b, q in enumerate(query_lens) if q == 1]
    short = [b for b, q in enumerate(query_lens) if 1 < q <= SHORT_QUERY_TOKENS]
    prefill = [b for b, q in enumerate(query_lens) if q > SHORT_QUERY_TOKENS]
    return decode, short, prefill


def build_groups(batch: InputBatch) -> AttentionMetadata:
    """Split the batch's requests into the decode / short / prefill groups (see the module docstring).

    Causality: request b's query i sits at position ``seq_lens[b] - q_len + i`` and sees keys ``0..`` that
    position, so a chunk ``[s, s+q)`` reads exactly the ``s + q`` keys written so far.
    """
    return AttentionMetadata([build_group(m, batch) for m in split_requests(batch.query_lens) if m])


def build_group(members: list[int], batch: InputBatch) -> AttentionGroup:
    """The ``AttentionGroup`` of requests ``members`` (indices into the batch's requests, in flat order)."""
    bs = batch.block_size
    idx = torch.tensor(members)
    q_start = batch.query_start_loc[idx]
    q_len = batch.query_start_loc[idx + 1] - q_start
    s_len = batch.seq_lens[idx]
    q_max = max(batch.query_lens[i] for i in members)
    n_blocks = max(-(-batch.context_lens[i] // bs) for i in members)
    rows = torch.arange(q_max)
    valid = rows[None, :] < q_len[:, None]  # [b, q_max]
    query_index = torch.where(valid, q_start[:, None] + rows[None, :], torch.zeros((), dtype=torch.long))
    tables = batch.block_tables[idx, :n_blocks].contiguous()
    # Query row i of request r is at absolute position (s_len - q_len + i); it sees keys j <= that position.
    q_pos = (s_len - q_len)[:, None] + rows[None, :]  # [b, q_max]
    keys = torch.arange(n_blocks * bs)
    mask = keys[None, None, :] <= q_pos[:, :, None]
    mask[:, :, 0] = True  # padded rows see key 0 so their (discarded) softmax is finite
    flat_valid = valid.reshape(-1)
    out_index = query_index.reshape(-1)[flat_valid]
    first = int(q_start[0])
    dense = bool(flat_valid.all()) and out_index.equal(torch.arange(first, first + len(out_index)))
    return AttentionGroup(
        query_index=query_index,
        query_valid=flat_valid,
        out_index=out_index,
        block_tables=tables.reshape(-1),
        attn_mask=mask[:, None, :, :],
        rows=(first, first + len(out_index)) if dense else None,
        is_causal=q_max > 1 and bool((s_len == q_len).all()),
        q_pos=q_pos,
    )


def window_mask(g: AttentionGroup, sliding_window: Optional[int]) -> torch.Tensor:
    """``g.attn_mask`` narrowed to a sliding window: query row at position ``p`` sees keys ``p - sliding_window < j
    <= p`` (Hugging Face's ``sliding_window_overlay``); padded rows keep key 0. ``None``: ``g.attn_mask``."""
    if sliding_window is None:
        return g.attn_mask
    mask = g.window_masks.get(sliding_window)
    if mask is None:
        b, q_max = g.q_pos.shape
        keys = torch.arange(g.attn_mask.shape[-1], device=g.q_pos.device)
        mask = g.attn_mask & (keys[None, None, :] > g.q_pos[:, :, None] - sliding_window)[:, None]
        mask[:, 0, :, 0] |= ~g.query_valid.view(b, q_max)  # padded rows: a finite (discarded) softmax
        g.window_masks[sliding_window] = mask
    return mask


class TorchSDPABackend(AttentionBackend):
    """Gather + ``scaled_dot_product_attention`` per group; runs on any device and dtype."""

    name = "torch-sdpa"

    def build_metadata(self, batch: InputBatch) -> AttentionMetadata:
        return build_groups(batch)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_mask(sliding_window, logit_softcap)
        out = torch.empty_like(q)
        for g in meta.groups:
            sdpa_group(q, kv_cache, g, scale, out, sliding_window, logit_softcap, sinks)
        return out


def sdpa_group(q: torch.Tensor, kv_cache: torch.Tensor, g: AttentionGroup, scale: float, out: torch.Tensor,
               sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None) -> None:
    """One group: gather its blocks into a padded copy, one SDPA call, scatter the real rows into ``out``.

    ``q``: ``[T, H_q, D]`` (rows may be strided); ``kv_cache``: one layer's ``[2, num_blocks, block_size, H_kv, D]``
    (any pool dtype, int8's rows ``D + 2``: read as ``q``'s, ``kv_layout.to_float``);
    ``out``: ``[T, H_q, D]``, only the group's rows are written. ``sliding_window`` narrows the mask
    (``window_mask``); with ``logit_softcap`` the scores are computed, capped (``c * tanh(s / c)``, Gemma 2) and
    softmaxed as PyTorch ops (SDPA has no cap); so are they with ``sinks`` (``[H_q]``: each head's sink logit joins
    the softmax as one more column, then is dropped, as ``transformers``' ``GptOssAttention``)."""
    h_q, d = q.shape[1:]
    h_kv = kv_cache.shape[-2]
    b, q_max = g.query_index.shape
    if g.rows is not None:
        qg = q[g.rows[0] : g.rows[1]].reshape(b, q_max, h_q, d).transpose(1, 2)  # [b, H_q, q_max, D]
    else:
        qg = q[g.query_index].transpose(1, 2)
    # index_select on the block dimension: one contiguous copy per block (faster than advanced indexing per token)
    # (a cache of another dtype, kv_cache_dtype, is widened -- an int8 one dequantized -- to the queries' dtype on
    # the gathered copy)
    k = to_float(kv_cache[0].index_select(0, g.block_tables), q.dtype).view(b, -1, h_kv, d).transpose(1, 2)
    v = to_float(kv_cache[1].index_select(0, g.block_tables), q.dtype).view(b, -1, h_kv, d).transpose(1, 2)
    if logit_softcap is not None or sinks is not None:
        k, v = (x.repeat_interleave(h_q // h_kv, 1) for x in (k, v))
        s = (qg @ k.transpose(2, 3)) * scale
        if logit_softcap is not None:
            s = torch.tanh(s / logit_softcap) * logit_softcap
        s = s.masked_fill(~window_mask(g, sliding_window), float("-inf"))
        if sinks is None:
            o = s.softmax(-1) @ v
        else:
            sink = sinks.to(s.dtype).view(1, h_q, 1, 1).expand(b, h_q, q_max, 1)
            o = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1] @ v
    elif g.is_causal and sliding_window is None:  # row i sees keys 0..i (top-left); padded rows' outputs discarded
        o = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=scale, enable_gqa=h_q != h_kv)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=window_mask(g, sliding_window), scale=scale,
                                           enable_gqa=h_q != h_kv)
    o = o.transpose(1, 2).reshape(b * q_max, h_q, d)
    if g.rows is not None:
        out[g.rows[0] : g.rows[1]] = o
    else:
        out[g.out_index] = o[g.query_valid]
