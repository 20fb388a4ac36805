"""The paged-attention kernel (``csrc/paged_attention.c``), one kernel for every query length, in each build this CPU
runs (``ATTENTION_ISAS``): the values of plain causal attention, and a query row's bits fixed by its query and the
keys and values up to its position alone -- the same whether the row arrives as a decode token, inside a chunk of
any length, beside other requests, or with any thread count. No model: random Q/K/V in a scattered pool."""

import math

import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from tests.conftest import scattered_block_tables

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))

BUILDS = [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
    isa not in cpu_kernels.attention_isas(), reason=f"this CPU does not run the {isa} build"))
    for isa in cpu_kernels.ATTENTION_ISAS]


def kernel_queries(q, d, isa, kv_dtype):
    """The queries the kernel's scores multiply, before the scale: ``q``, except under the AMX build over a bfloat16
    cache, whose tiles take q * d^-0.5 rounded to bfloat16 (returned divided by the scale again, float64)."""
    if isa != "amx" or kv_dtype != torch.bfloat16:
        return q
    scale = torch.tensor(d**-0.5, dtype=torch.float32)  # the kernel's float32 scale
    return (q.float() * scale).to(torch.bfloat16).double() / scale.double()


def _pool(reqs, h_kv, d, bs, kv_dtype, seed=7):
    """A cache holding every request's keys and values in scattered blocks, and the block tables."""
    g = torch.Generator().manual_seed(seed)
    tables = scattered_block_tables(reqs, bs)
    cache = torch.randn(2, sum(len(t) for t in tables), bs, h_kv, d, generator=g).to(kv_dtype)
    return cache, tables


def _attend(q, cache, tables, rows, isa, threads=None, window=None, cap=None, sinks=None):
    """``rows``: per request ``(table index, first query row's position, query rows)``; q: those rows in order;
    ``window``, ``cap``, ``sinks``: the kernel's sliding window, logit soft-cap and attention sinks."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i, _, _ in rows])
    q_len = torch.tensor([n for _, _, n in rows])
    seq_len = torch.tensor([p + n for _, p, n in rows])
    q_start = torch.cumsum(q_len, 0) - q_len
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # the same OpenMP runtime as the kernels
    try:
        assert cpu_kernels.paged_attention(q, cache, block_tables, q_start, q_len, seq_len, q.shape[-1] ** -0.5,
                                           out, isa, window, cap, sinks)
    finally:
        torch.set_num_threads(before)
    return out


SHAPES = [
    ([(700, 1)], 9, 3, 64, 16),  # one decode, SmolLM2's heads
    ([(300, 5), (451, 1), (90, 3)], 9, 3, 64, 16),  # verification spans beside a decode
    ([(0, 130), (20, 77)], 10, 2, 32, 16),  # prompts: 5 query heads per KV head, a chunk after earlier context
    ([(2000, 2)], 4, 4, 16, 7),  # MHA, the smallest D of the AVX-512 build, a block size not a power of two
    ([(5, 1), (600, 1)], 8, 1, 128, 16),  # MQA; a short request beside a long one
    ([(0, 1000)], 9, 3, 64, 16),  # a 1,000-token prompt in one chunk
    # 24 decodes at D = 80: the weighted sums' paired 64 columns then 16 alone, a query tile's half-filled chunk, and
    # enough (request, query block) groups for a thread to take a request's KV heads together
    ([(40 + 7 * i, 1) for i in range(24)], 6, 2, 80, 16),
]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reqs, h_q, h_kv, d, bs", SHAPES)
def test_causal_attention_values_and_the_same_bits_on_any_thread_count(reqs, h_q, h_kv, d, bs, kv_dtype, isa):
    cache, tables = _pool(reqs, h_kv, d, bs, kv_dtype)
    g = torch.Generator().manual_seed(1)
    rows = [(i, c, n) for i, (c, n) in enumerate(reqs)]
    q = torch.randn(sum(n for _, n in reqs), h_q, d, generator=g) * 2
    one = _attend(q, cache, tables, rows, isa, threads=1)
    for threads in (2, 3):
        assert torch.equal(_attend(q, cache, tables, rows, isa, threads), one)
    start = 0
    for (ctx, n), table in zip(reqs, tables):
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(ctx + n)])
        k, v = (cache[i].reshape(-1, h_kv, d)[slots].float().repeat_interleave(h_q // h_kv, 1).transpose(0, 1)
                for i in (0, 1))
        qq = kernel_queries(q[start: start + n], d, isa, kv_dtype).double().transpose(0, 1)  # [H_q, n, D]
        mask = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
        ref = ((qq @ k.double().transpose(1, 2)) * d**-0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ v.double()
        torch.testing.assert_close(one[start: start + n].double(), ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
        start += n


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_q, h_kv, d, bs", [(9, 3, 64, 16), (8, 2, 128, 16), (6, 6, 32, 5)])
def test_a_row_gives_the_same_bits_however_it_is_scheduled(h_q, h_kv, d, bs, kv_dtype, isa):
    """A 300-token prompt after 37 tokens of context: in one call; in chunks of 1 (decode tokens), 16, 64 and
    uneven sizes; and as one request among others of every kind, before and after it. Every row equal bit for bit."""
    ctx, n = 37, 300
    others = [(0, 50), (400, 1), (90, 7)]
    cache, tables = _pool([(ctx, n)] + others, h_kv, d, bs, kv_dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(n, h_q, d, generator=g)
    whole = _attend(q, cache, tables, [(0, ctx, n)], isa)
    for sizes in ([1] * 40 + [n - 40], [16] * 18 + [12], [64] * 4 + [44], [3, 250, 47]):
        start, parts = 0, []
        for size in sizes:
            parts.append(_attend(q[start: start + size], cache, tables, [(0, ctx + start, size)], isa))
            start += size
        assert torch.equal(torch.cat(parts), whole), sizes
    q_others = [torch.randn(m, h_q, d, generator=g) for _, m in others]
    rows = [(1, *others[0]), (0, ctx, n), (2, *others[1]), (3, *others[2])]
    mixed = _attend(torch.cat([q_others[0], q, *q_others[1:]]), cache, tables, rows, isa)
    assert torch.equal(mixed[50: 50 + n], whole)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_the_same_keys_give_the_same_bits_in_any_block_size(isa, kv_dtype):
    """The same keys and values (positions 0..299 of two requests) in pools of 16-, 32- and 5-token blocks: every
    row's bits are equal. (The AMX build reads a 16-key tile in place from a block of 16 or 32, and copies it
    first from blocks of 5: the copy must change nothing.)"""
    h_q, h_kv, d, reqs = 9, 3, 64, [(250, 50), (299, 1)]
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 300, h_kv, d, generator=g).to(kv_dtype)  # [K/V, request, position, H_kv, D]
    q = torch.randn(51, h_q, d, generator=g)
    outs = []
    for bs in (16, 32, 5):
        tables = scattered_block_tables(reqs, bs)
        cache = torch.zeros(2, sum(len(t) for t in tables), bs, h_kv, d, dtype=kv_dtype)
        for r, table in enumerate(tables):
            for j in range(300):
                cache[:, table[j // bs], j % bs] = k[:, r, j]
        outs.append(_attend(q, cache, tables, [(0, 250, 50), (1, 299, 1)], isa))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("isa", BUILDS)
def test_keys_scored_more_than_64_below_the_row_maximum_contribute_exactly_nothing(isa):
    """A probability below e^-64 of the largest is 0, not a subnormal float (SOFTMAX_FLUSH): key 0 scored 80 below
    key 1 has its value vector multiplied by exactly 0 (a value of 1e30 there changes no bit), while a key scored 60
    below still counts (its 1e30 shows)."""
    h, d, bs = 1, 16, 16
    cache = torch.zeros(2, 1, bs, h, d)
    q = torch.zeros(1, h, d)
    q[0, 0, 0] = 4.0  # scale d ** -0.5 = 1/4: scores = K[:, 0]
    cache[0, 0, 1, 0, 0] = 80.0  # key 1 the maximum, key 0 at 0 (80 below), key 2 at 20 (60 below)
    cache[0, 0, 2, 0, 0] = 20.0
    cache[1, 0, 1, 0, :] = 1.0
    base = _attend(q, cache, [[0]], [(0, 2, 1)], isa)
    assert torch.equal(base, torch.ones_like(base))  # keys 0..2: key 1 alone has weight (up to rounding: exactly 1)
    cache[1, 0, 0, 0, :] = 1e30  # key 0's value: weight 0, no change
    assert torch.equal(_attend(q, cache, [[0]], [(0, 2, 1)], isa), base)
    cache[1, 0, 2, 0, :] = 1e30  # key 2's value: weight e^-60 ~ 8.8e-27, seen
    got = _attend(q, cache, [[0]], [(0, 2, 1)], isa)
    assert torch.allclose(got, torch.full_like(got, 1 + 1e30 * math.exp(-60)), rtol=1e-5)
