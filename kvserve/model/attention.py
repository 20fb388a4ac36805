"""Paged attention over a flat token batch (PagedAttention, Kwon et al., SOSP 2023, §4.1).

The KV cache of one layer is ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at 0, V at 1).
Token ``t`` of the flat batch writes its K/V to slot ``slot_mapping[t] = block_id * block_size + offset``.
A request's keys are read back in logical order through its ``block_table`` with one batched gather.

Requests are split into at most three groups per step, built once in ``AttentionMetadata.build``: decode
requests (one query token each), short queries (2..``SHORT_QUERY_TOKENS`` tokens: speculative verification spans,
short chunks) and prefill requests (a prompt or chunk), each padded to its group's longest. Each group is one
``scaled_dot_product_attention`` call per layer, so no Python loop runs over requests inside a layer, and a long
prompt in the batch does not pad every decode or verifying request to its length.

On a float32 CPU with kvserve's kernels built (``cpu_kernels``), the decode and short groups instead run
``csrc/paged_attention.c``, which reads each request's K/V in place from its blocks: the gather above copies
every key and value once more per layer (at 16 decodes x 384 tokens, 9.4 MB per layer), which made attention
about a fifth of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels


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
            ``attn_mask``.
        q_start, q_len, seq_len: ``[b]`` int64, each member's first flat row, query rows and keys (for the
            in-place kernel).
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor
    out_index: torch.Tensor
    block_tables: torch.Tensor
    attn_mask: torch.Tensor
    rows: Optional[tuple] = None
    is_causal: bool = False
    q_start: Optional[torch.Tensor] = None
    q_len: Optional[torch.Tensor] = None
    seq_len: Optional[torch.Tensor] = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, used by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each flat-batch token.
        groups: one ``AttentionGroup`` for decode requests and/or one for prefill requests.
    """

    slot_mapping: torch.Tensor
    groups: list

    @staticmethod
    def build(
        query_start_loc: list,
        seq_lens: list,
        block_tables: list,
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> "AttentionMetadata":
        """Build the metadata of a flat batch of B requests.

        Args:
            query_start_loc: ``B + 1`` ints; request b owns flat rows ``[qsl[b], qsl[b+1])``.
            seq_lens: ``B`` ints, tokens in context after this step (computed before + scheduled now).
            block_tables: ``B`` lists of block ids (each covers at least ``seq_lens[b]`` tokens).
            slot_mapping: ``[T]`` int64.
            block_size: tokens per block.

        Causality: request b's query i sits at position ``seq_lens[b] - q_len + i`` and sees keys ``0..`` that
        position, so a chunk ``[s, s+q)`` reads exactly the ``s + q`` keys written so far.
        """
        q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))]
        decode = [b for b, q in enumerate(q_lens) if q == 1]
        short = [b for b, q in enumerate(q_lens) if 1 < q <= SHORT_QUERY_TOKENS]
        prefill = [b for b, q in enumerate(q_lens) if q > SHORT_QUERY_TOKENS]
        groups = [
            _build_group(members, query_start_loc, q_lens, seq_lens, block_tables, block_size)
            for members in (decode, short, prefill)
            if members
        ]
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups)


def _build_group(members, query_start_loc, q_lens, seq_lens, block_tables, block_size) -> AttentionGroup:
    b = len(members)
    q_max = max(q_lens[i] for i in members)
    n_blocks = max(-(-seq_lens[i] // block_size) for i in members)
    q_start = torch.tensor([query_start_loc[i] for i in members])
    q_len = torch.tensor([q_lens[i] for i in members])
    s_len = torch.tensor([seq_lens[i] for i in members])
    rows = torch.arange(q_max)
    valid = rows[None, :] < q_len[:, None]  # [b, q_max]
    query_index = torch.where(valid, q_start[:, None] + rows[None, :], torch.zeros((), dtype=torch.long))
    tables = torch.zeros(b, n_blocks, dtype=torch.long)
    for r, i in enumerate(members):
        ids = block_tables[i][:n_blocks]
        tables[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    # Query row i of request r is at absolute position (s_len - q_len + i); it sees keys j <= that position.
    q_pos = (s_len - q_len)[:, None] + rows[None, :]  # [b, q_max]
    keys = torch.arange(n_blocks * block_size)
    mask = keys[None, None, :] <= q_pos[:, :, None]
    mask[:, :, 0] = True  # padded rows see key 0 so their (discarded) softmax is finite
    flat_valid = valid.reshape(-1)
    out_index = query_index.reshape(-1)[flat_valid]
    first = query_start_loc[members[0]]
    dense = bool(flat_valid.all()) and out_index.equal(torch.arange(first, first + len(out_index)))
    return AttentionGroup(
        query_index=query_index,
        query_valid=flat_valid,
        out_index=out_index,
        block_tables=tables.reshape(-1),
        attn_mask=mask[:, None, :, :],
        rows=(first, first + len(out_index)) if dense else None,
        is_causal=q_max > 1 and bool((s_len == q_len).all()),
        q_start=q_start,
        q_len=q_len,
        seq_len=s_len,
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into their slots.

    Args:
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``.
        k, v: ``[T, H_kv, D]``.
        slot_mapping: ``[T]`` int64.
    """
    h, d = kv_cache.shape[-2:]
    kv_cache[0].view(-1, h, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, h, d).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the flat batch's queries over each request's paged K/V (already written).

    Args:
        q: ``[T, H_q, D]``.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``.
        meta: the step's metadata.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[T, H_q, D]``, same dtype as ``q``. GQA: ``H_q`` must be a multiple of ``H_kv``.
    """
    t, h_q, d = q.shape
    h_kv = kv_cache.shape[-2]
    out = torch.empty(t, h_q, d, dtype=q.dtype)
    kernel = cpu_kernels.load() is not None and kv_cache.device.type == "cpu"
    for g in meta.groups:
        b, q_max = g.query_index.shape
        if kernel and q_max <= SHORT_QUERY_TOKENS and cpu_kernels.paged_attention(
            q, kv_cache, g.block_tables.view(b, -1), g.q_start, g.q_len, g.seq_len, scale, out
        ):
            continue  # decode and short groups: read in place from the blocks, no gathered copy
        if g.rows is not None:
            qg = q[g.rows[0] : g.rows[1]].reshape(b, q_max, h_q, d).transpose(1, 2)  # [b, H_q, q_max, D]
        else:
            qg = q[g.query_index].transpose(1, 2)
        # index_select on the block dimension: one contiguous copy per block, ~2x faster than advanced indexing
        k = kv_cache[0].index_select(0, g.block_tables).view(b, -1, h_kv, d).transpose(1, 2)  # [b, H_kv, L, D]
        v = kv_cache[1].index_select(0, g.block_tables).view(b, -1, h_kv, d).transpose(1, 2)
        if g.is_causal:  # row i sees keys 0..i (top-left aligned); padded rows' outputs are discarded
            o = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=scale, enable_gqa=h_q != h_kv)
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.attn_mask, scale=scale, enable_gqa=h_q != h_kv)
        o = o.transpose(1, 2).reshape(b * q_max, h_q, d)
        if g.rows is not None:
            out[g.rows[0] : g.rows[1]] = o
        else:
            out[g.out_index] = o[g.query_valid]
    return out
