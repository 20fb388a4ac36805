"""Attention sinks (gpt-oss: a learned logit per query head in every row's softmax denominator) in every attention
path: the paged-attention kernel (each build this CPU runs; float32, bfloat16 and int8 caches), the CPU backend's
one-call layer and the gather + SDPA reference backend. Values against a float64 reference, with and without a
sliding window; the kernel's batch invariance kept (a row's bits do not depend on its chunking or the thread
count); sinks of -inf give the plain kernel's bits. No model."""

import pytest
import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.kv_layout import from_float, to_float
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.rotary import apply_rotary
from tests.attention.test_fused_attention import BATCHES, _setup
from tests.attention.test_paged_attention_kernel import BUILDS, _attend as attend, _pool, kernel_queries
from tests.attention.test_sliding_window import _keys, _tables

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


def reference(q, k, v, positions, scale, sinks, window=None):
    """float64 attention with sinks, as ``transformers``' gpt-oss ``eager_attention_forward``: ``q [n, H_q, D]`` at
    ``positions [n]`` over ``k, v [L, H_kv, D]``; ``sinks [H_q]`` joins each row's softmax as one more column."""
    h_q, h_kv = q.shape[1], k.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k, v = k.repeat_interleave(h_q // h_kv, 0), v.repeat_interleave(h_q // h_kv, 0)
    s = (q @ k.transpose(1, 2)) * scale
    j, p = torch.arange(k.shape[1])[None, :], positions[:, None]
    mask = (j <= p) & ((j > p - window) if window is not None else True)
    s = s.masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.double().view(h_q, 1, 1).expand(h_q, s.shape[1], 1)], dim=-1)
    return (s.softmax(-1)[..., :-1] @ v).transpose(0, 1)


def _attend(q, cache, tables, rows, isa, sinks, window=None, threads=None):
    return attend(q, cache, tables, rows, isa, threads, window, None, sinks)


SHAPES = [
    ([(300, 5), (451, 1), (90, 3)], 8, 2, 64, 16),  # verification spans beside a decode
    ([(0, 130), (20, 77)], 8, 1, 32, 16),  # prompts crossing a window edge mid-chunk
]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("reqs, h_q, h_kv, d, bs", SHAPES)
def test_sink_values_against_float64_on_any_thread_count(reqs, h_q, h_kv, d, bs, kv_dtype, isa):
    cache, tables = _pool(reqs, h_kv, d, bs, torch.float32)
    if kv_dtype == torch.int8:  # rows of D values and a scale (kv_layout)
        cache = from_float(cache, torch.int8)
    else:
        cache = cache.to(kv_dtype)
    g = torch.Generator().manual_seed(3)
    rows = [(i, c, n) for i, (c, n) in enumerate(reqs)]
    q = torch.randn(sum(n for _, n in reqs), h_q, d, generator=g) * 2
    # sinks far below, around and far above the scores (a sink above every score takes most of the mass)
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 4.0, 8.0, 30.0])[:h_q].contiguous()
    f = to_float(cache, torch.float32)  # what the kernel reads
    for window in (None, 16, 128):
        one = _attend(q, cache, tables, rows, isa, sinks, window, threads=1)
        assert torch.equal(_attend(q, cache, tables, rows, isa, sinks, window, threads=2), one)
        start = 0
        for (ctx, n), table in zip(reqs, tables):
            k, v = _keys(f, table, ctx + n, bs, 0), _keys(f, table, ctx + n, bs, 1)
            ref = reference(kernel_queries(q[start: start + n], d, isa, kv_dtype), k, v, ctx + torch.arange(n),
                            d**-0.5, sinks, window)
            torch.testing.assert_close(one[start: start + n].double(), ref, rtol=1e-4, atol=2e-5,
                                       msg=f"window {window}")
            start += n


@pytest.mark.parametrize("isa", BUILDS)
def test_sinks_of_minus_infinity_give_the_plain_kernels_bits_and_chunks_do_not_move_a_row(isa):
    ctx, n, h_q, h_kv, d, bs = 37, 200, 8, 2, 64, 16
    cache, tables = _pool([(ctx, n)], h_kv, d, bs, torch.float32)
    q = torch.randn(n, h_q, d, generator=torch.Generator().manual_seed(2))
    none = torch.full((h_q,), float("-inf"))
    plain = torch.full_like(q, float("nan"))
    rows = [(0, ctx, n)]
    assert torch.equal(_attend(q, cache, tables, rows, isa, none, 64),
                       _attend(q, cache, tables, rows, isa, None, 64))
    sinks = torch.linspace(-2, 3, h_q)
    whole = _attend(q, cache, tables, rows, isa, sinks, 64)
    assert not torch.equal(whole, _attend(q, cache, tables, rows, isa, None, 64)) and plain.isnan().all()
    for sizes in ([1] * 20 + [n - 20], [64, 64, 72], [3, 150, 47]):
        start, parts = 0, []
        for size in sizes:
            parts.append(_attend(q[start: start + size], cache, tables, [(0, ctx + start, size)], isa, sinks, 64))
            start += size
        assert torch.equal(torch.cat(parts), whole), sizes


@pytest.mark.parametrize("batch_name", ["mixed", "prompts", "decodes-at-block-edges"])
@pytest.mark.parametrize("window", [None, 4])
def test_the_backends_agree_with_float64_and_the_fused_call_with_the_unfused(batch_name, window):
    reqs, (h_q, h_kv, d, bs) = BATCHES[batch_name], (6, 2, 32, 4)
    cache, batch, qkv, rope = _setup(reqs, h_q, h_kv, d, bs)
    scale, sinks = d**-0.5, torch.tensor([-3.0, 0.0, 1.0, 2.5, 0.3, 6.0])
    outs = {}
    for name, be in (("sdpa", TorchSDPABackend()), ("cpu", CPUKernelAttentionBackend())):
        c = cache.clone()
        outs[name] = be.forward_qkv(qkv.clone(), h_q, c, be.build_metadata(batch), rope, batch, scale,
                                    sliding_window=window, sinks=sinks)
        outs[name + "-cache"] = c
    be = CPUKernelAttentionBackend()
    unfused = AttentionBackend.forward_qkv(be, qkv.clone(), h_q, cache.clone(), be.build_metadata(batch), rope,
                                           batch, scale, sliding_window=window, sinks=sinks)
    assert torch.equal(unfused, outs["cpu"])
    q = apply_rotary(qkv[:, : (h_q + h_kv) * d].view(-1, h_q + h_kv, d), *rope)[:, :h_q]
    start = 0
    for (ctx, n), table in zip(reqs, _tables(batch)):
        k, v = _keys(outs["cpu-cache"], table, ctx + n, bs, 0), _keys(outs["cpu-cache"], table, ctx + n, bs, 1)
        ref = reference(q[start: start + n], k, v, ctx + torch.arange(n), scale, sinks, window).reshape(n, -1)
        for name in ("sdpa", "cpu"):
            torch.testing.assert_close(outs[name][start: start + n].double(), ref, rtol=1e-4, atol=1e-5, msg=name)
        start += n


def test_sinks_of_the_wrong_shape_are_refused():
    cache, batch, qkv, rope = _setup([(3, 2)], 2, 1, 16, 4)
    be = CPUKernelAttentionBackend()
    with pytest.raises(ValueError, match="sinks"):
        be.forward_qkv(qkv, 2, cache, be.build_metadata(batch), rope, batch, 0.25, sinks=torch.zeros(3))
