"""The paged-attention kernel's spread path (``attend_spread`` in ``csrc/paged_attention_kv.h``: a few requests' keys,
softmaxes and weighted sums split over the threads inside each request) gives the same bits as the one-thread path,
where each request is one task, and the values of plain causal attention. It runs when the step has fewer than two
requests per thread, enough work (``SPREAD_MIN_MACS``) and scores that fit ``SPREAD_MAX_SCORE_FLOATS``, so these
contexts are long (the last case is over that cap: one task per request). No model: random K/V in a
scattered pool."""

import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from tests.conftest import scattered_block_tables

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


def _attend(q, cache, tables, q_start, q_len, seq_len, scale, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the same OpenMP runtime as the kernels
    try:
        out = torch.full_like(q, float("nan")).contiguous()
        assert cpu_kernels.paged_attention(q, cache, tables, q_start, q_len, seq_len, scale, out)
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reqs, h_q, h_kv, d, bs", [
    ([(700, 1)], 9, 3, 64, 16),  # one decode, SmolLM2's heads
    ([(300, 5), (451, 1), (90, 3)], 9, 3, 64, 16),  # three requests, verification spans (causal inside the span)
    ([(800, 1)], 10, 2, 32, 16),  # 5 query heads per KV head: more than one pass of SPREAD_MAX_G
    ([(2000, 2)], 4, 4, 16, 7),  # MHA, the smallest D the spread takes, a block size not a power of two
    ([(5, 1), (600, 1)], 8, 1, 128, 16),  # MQA; a short request beside a long one
    ([(14000, 40)], 9, 3, 64, 16),  # scores over SPREAD_MAX_SCORE_FLOATS: one task per request (same bits)
])
def test_spread_equals_one_thread_bit_for_bit_and_causal_attention(reqs, h_q, h_kv, d, bs, kv_dtype):
    g = torch.Generator().manual_seed(7)
    tables = scattered_block_tables(reqs, bs)
    num_blocks = sum(len(t) for t in tables)
    cache = torch.randn(2, num_blocks, bs, h_kv, d, generator=g).to(kv_dtype)
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    q_len = torch.tensor([q for _, q in reqs])
    seq_len = torch.tensor([c + q for c, q in reqs])
    q_start = torch.cumsum(q_len, 0) - q_len
    q = torch.randn(int(q_len.sum()), h_q, d, generator=g) * 2
    scale = d**-0.5
    one = _attend(q, cache, block_tables, q_start, q_len, seq_len, scale, threads=1)
    for threads in (2, 3):
        assert torch.equal(_attend(q, cache, block_tables, q_start, q_len, seq_len, scale, threads), one)
    for b, ((ctx, n), table) in enumerate(zip(reqs, tables)):
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(ctx + n)])
        k, v = (cache[i].reshape(-1, h_kv, d)[slots].float().repeat_interleave(h_q // h_kv, 1).transpose(0, 1)
                for i in (0, 1))
        qq = q[q_start[b]: q_start[b] + n].transpose(0, 1)  # [H_q, n, D]
        mask = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
        ref = ((qq @ k.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(one[q_start[b]: q_start[b] + n], ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
