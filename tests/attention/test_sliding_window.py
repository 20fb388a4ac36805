"""Sliding-window attention and attention-logit soft-capping in every attention path: the paged-attention kernel
(``csrc/paged_attention.c``, each build this CPU runs, float32 and bfloat16 caches), the CPU backend's one-call layer
and the gather + SDPA reference backend. Values against a float64 reference at many shapes; the kernel's batch
invariance kept (a row's bits fixed by its query and its window's keys and values alone: any chunking, batch or
thread count); keys outside the window never read (poisoned with NaN, the bits do not move). No model."""

import pytest
import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.rotary import apply_rotary
from tests.attention.test_fused_attention import BATCHES, _setup
from tests.attention.test_paged_attention_kernel import BUILDS, _attend as attend, _pool, kernel_queries

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


def _attend(q, cache, tables, rows, isa, window=None, cap=None, threads=None):
    return attend(q, cache, tables, rows, isa, threads, window, cap)


def reference(q, k, v, positions, scale, window=None, cap=None):
    """float64 attention: ``q [n, H_q, D]`` at ``positions [n]`` over ``k, v [L, H_kv, D]`` (key j at position j)."""
    h_q, h_kv = q.shape[1], k.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k, v = k.repeat_interleave(h_q // h_kv, 0), v.repeat_interleave(h_q // h_kv, 0)
    s = (q @ k.transpose(1, 2)) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    j = torch.arange(k.shape[1])[None, :]
    p = positions[:, None]
    mask = (j <= p) & ((j > p - window) if window is not None else True)
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def _keys(cache, table, n, bs, i):
    h_kv, d = cache.shape[-2:]
    slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)])
    return cache[i].reshape(-1, h_kv, d)[slots].float()


SHAPES = [
    ([(700, 1)], 9, 3, 64, 16),  # decode far past the window
    ([(300, 5), (451, 1), (90, 3)], 9, 3, 64, 16),  # verification spans beside a decode
    ([(0, 130), (20, 77)], 10, 2, 32, 16),  # prompts crossing the window edge mid-chunk
    ([(2000, 2)], 4, 4, 16, 7),  # MHA, block size 7
    ([(5, 1), (600, 1)], 8, 1, 128, 16),  # MQA; a request shorter than the window beside a long one
    ([(0, 300)], 9, 3, 64, 16),  # a prompt many windows long in one chunk
]
#: (sliding window, soft-cap): a window of one key, windows inside a tile, across tiles and blocks, wider than any
#: context; caps that bend every score (2) or only the large ones (30); a cap alone.
MASKS = [(1, None), (5, 2.0), (16, None), (33, 30.0), (100, 2.0), (4096, None), (None, 2.0)]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reqs, h_q, h_kv, d, bs", SHAPES)
def test_window_and_softcap_values_against_float64_on_any_thread_count(reqs, h_q, h_kv, d, bs, kv_dtype, isa):
    cache, tables = _pool(reqs, h_kv, d, bs, kv_dtype)
    g = torch.Generator().manual_seed(3)
    rows = [(i, c, n) for i, (c, n) in enumerate(reqs)]
    q = torch.randn(sum(n for _, n in reqs), h_q, d, generator=g) * 3  # large scores: the cap bends them
    kv = [(_keys(cache, table, ctx + n, bs, 0), _keys(cache, table, ctx + n, bs, 1))
          for (ctx, n), table in zip(reqs, tables)]
    for window, cap in MASKS:
        one = _attend(q, cache, tables, rows, isa, window, cap, threads=1)
        assert torch.equal(_attend(q, cache, tables, rows, isa, window, cap, threads=2), one)
        start = 0
        for (ctx, n), (k, v) in zip(reqs, kv):
            ref = reference(kernel_queries(q[start: start + n], d, isa, kv_dtype), k, v, ctx + torch.arange(n),
                            d**-0.5, window, cap)
            torch.testing.assert_close(one[start: start + n].double(), ref, rtol=1e-4, atol=2e-5,
                                       msg=f"window {window} cap {cap}")
            start += n


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_window_wider_than_the_context_and_no_cap_give_the_plain_kernels_bits(kv_dtype, isa):
    reqs = [(300, 5), (0, 90), (17, 1)]
    cache, tables = _pool(reqs, 3, 64, 16, kv_dtype)
    q = torch.randn(96, 9, 64, generator=torch.Generator().manual_seed(4))
    rows = [(i, c, n) for i, (c, n) in enumerate(reqs)]
    assert torch.equal(_attend(q, cache, tables, rows, isa, window=306), _attend(q, cache, tables, rows, isa))


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, cap", [(7, None), (40, None), (40, 5.0), (None, 5.0)])
@pytest.mark.parametrize("h_q, h_kv, d, bs", [(9, 3, 64, 16), (6, 6, 32, 5)])
def test_a_row_gives_the_same_bits_however_it_is_scheduled(h_q, h_kv, d, bs, window, cap, kv_dtype, isa):
    """A 300-token prompt after 37 tokens of context: in one call; in chunks of 1 (decode tokens), 16, 64 and
    uneven sizes; as one request among others of every kind. Every row equal bit for bit."""
    ctx, n = 37, 300
    others = [(0, 50), (400, 1), (90, 7)]
    cache, tables = _pool([(ctx, n)] + others, h_kv, d, bs, kv_dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(n, h_q, d, generator=g)
    whole = _attend(q, cache, tables, [(0, ctx, n)], isa, window, cap)
    for sizes in ([1] * 40 + [n - 40], [16] * 18 + [12], [64] * 4 + [44], [3, 250, 47]):
        start, parts = 0, []
        for size in sizes:
            parts.append(_attend(q[start: start + size], cache, tables, [(0, ctx + start, size)], isa, window, cap))
            start += size
        assert torch.equal(torch.cat(parts), whole), sizes
    q_others = [torch.randn(m, h_q, d, generator=g) for _, m in others]
    rows = [(1, *others[0]), (0, ctx, n), (2, *others[1]), (3, *others[2])]
    for threads in (1, 3):
        mixed = _attend(torch.cat([q_others[0], q, *q_others[1:]]), cache, tables, rows, isa, window, cap, threads)
        assert torch.equal(mixed[50: 50 + n], whole)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_keys_before_the_window_are_never_read(kv_dtype, isa):
    """Each decode row at position p, with every key and value before its window (positions <= p - window) set to
    NaN: the same bits as with the real values there (a masked key contributes exactly nothing)."""
    window, bs, h_kv, d = 24, 16, 2, 32
    cache, tables = _pool([(500, 1)], h_kv, d, bs, kv_dtype)
    q = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(5))
    for p in (23, 24, 25, 40, 47, 48, 200, 499):
        clean = _attend(q, cache, tables, [(0, p, 1)], isa, window, 3.0)
        poisoned = cache.clone()
        for j in range(p - window + 1):
            b, o = tables[0][j // bs], j % bs
            poisoned[:, b, o] = float("nan")
        assert torch.equal(_attend(q, poisoned, tables, [(0, p, 1)], isa, window, 3.0), clean), p


@pytest.mark.parametrize("batch_name", ["mixed", "prompts", "decodes-at-block-edges"])
@pytest.mark.parametrize("window, cap", [(4, None), (11, 3.0), (None, 3.0), (64, None)])
def test_the_backends_agree_with_float64_and_the_fused_call_with_the_unfused(batch_name, window, cap):
    """TorchSDPA (the reference, used with cpu_kernels=False) and the CPU backend, through ``forward_qkv``, both
    equal float64 attention over the rotated keys; the CPU backend's one-call layer equals its PyTorch-ops default
    (``AttentionBackend.forward_qkv`` with the same kernel) bit for bit."""
    reqs, (h_q, h_kv, d, bs) = BATCHES[batch_name], (6, 2, 32, 4)
    cache, batch, qkv, rope = _setup(reqs, h_q, h_kv, d, bs)
    scale = d**-0.5
    outs = {}
    for name, be in (("sdpa", TorchSDPABackend()), ("cpu", CPUKernelAttentionBackend())):
        c = cache.clone()
        outs[name] = be.forward_qkv(qkv.clone(), h_q, c, be.build_metadata(batch), rope, batch, scale,
                                    sliding_window=window, logit_softcap=cap)
        outs[name + "-cache"] = c
    be = CPUKernelAttentionBackend()
    c = cache.clone()
    unfused = AttentionBackend.forward_qkv(be, qkv.clone(), h_q, c, be.build_metadata(batch), rope, batch, scale,
                                           sliding_window=window, logit_softcap=cap)
    assert torch.equal(unfused, outs["cpu"])
    q = apply_rotary(qkv[:, : (h_q + h_kv) * d].view(-1, h_q + h_kv, d), *rope)[:, :h_q]
    start = 0
    for (ctx, n), table in zip(reqs, _tables(batch)):
        k, v = _keys(outs["cpu-cache"], table, ctx + n, bs, 0), _keys(outs["cpu-cache"], table, ctx + n, bs, 1)
        ref = reference(q[start: start + n], k, v, ctx + torch.arange(n), scale, window, cap).reshape(n, -1)
        for name in ("sdpa", "cpu"):
            torch.testing.assert_close(outs[name][start: start + n].double(), ref, rtol=1e-4, atol=1e-5, msg=name)
        start += n


def _tables(batch):
    return [[int(b) for b in row] for row in batch.block_tables]


@pytest.mark.parametrize("be", [TorchSDPABackend(), CPUKernelAttentionBackend()], ids=["sdpa", "cpu"])
@pytest.mark.parametrize("kw, field", [(dict(sliding_window=0), "sliding_window"),
                                       (dict(logit_softcap=-1.0), "logit_softcap"),
                                       (dict(logit_softcap=0.0), "logit_softcap")])
def test_bad_window_or_cap_is_a_value_error_naming_it(be, kw, field):
    cache, batch, qkv, rope = _setup([(3, 2)], 2, 1, 16, 4)
    with pytest.raises(ValueError, match=field):
        be.forward_qkv(qkv, 2, cache, be.build_metadata(batch), rope, batch, 0.25, **kw)
