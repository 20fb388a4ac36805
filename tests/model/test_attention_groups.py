"""Paged attention over a flat batch mixing decode tokens, a 5-token verification span and a 40-token chunk
equals plain causal attention computed per request, with kvserve's in-place kernel (one call for every request) and
without it (gather + SDPA in up to three groups: decode, short, prefill). No model: random K/V in a small pool."""

import pytest
import torch

from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from tests.conftest import flat_batch, scattered_block_tables


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("reqs, num_groups, causal", [
    # decodes (one at a block edge) + verification spans + a chunk with earlier context
    ([(9, 1), (13, 5), (7, 40), (31, 1), (2, 3)], 3, False),
    ([(0, 40), (0, 33)], 1, True),  # fresh prompts of different lengths: SDPA is_causal with padded rows
    # six decodes and four spans: enough requests that each kernel task takes all KV heads of a request
    ([(5, 1), (17, 1), (3, 1), (40, 1), (8, 1), (0, 1), (6, 4), (11, 2), (20, 7), (1, 3)], 2, False),
])
def test_groups_match_per_request_causal_attention(reqs, num_groups, causal, use_kernel, monkeypatch):
    kernel_calls = []
    if use_kernel:
        if cpu_kernels.load() is None:
            pytest.skip(cpu_kernels.unavailable_reason())
        real = cpu_kernels.paged_attention
        monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a: kernel_calls.append(1) or real(*a))
    backend = CPUKernelAttentionBackend() if use_kernel else TorchSDPABackend()
    g = torch.Generator().manual_seed(0)
    bs, h_q, h_kv, d = 4, 6, 2, 8
    cache = torch.zeros(2, 64, bs, h_kv, d)
    # reqs: (tokens already in the cache, new query tokens) per request
    tables = scattered_block_tables(reqs, bs)
    ks, vs, qs, qsl = [], [], [], [0]
    for (ctx, q), table in zip(reqs, tables):
        k = torch.randn(ctx + q, h_kv, d, generator=g)
        v = torch.randn(ctx + q, h_kv, d, generator=g)
        if ctx:  # the earlier context, already computed
            backend.write_kv(cache, k[:ctx], v[:ctx], flat_batch([([0] * ctx, 0, table)], bs))
        ks.append(k), vs.append(v), qs.append(torch.randn(q, h_q, d, generator=g))
        qsl.append(qsl[-1] + q)
    batch = flat_batch([([0] * q, ctx, table) for (ctx, q), table in zip(reqs, tables)], bs)
    meta = backend.build_metadata(batch)
    sdpa_groups = 0 if use_kernel else num_groups  # the kernel takes every request
    assert len(meta.groups) == sdpa_groups and (not meta.groups or meta.groups[-1].is_causal == causal)
    backend.write_kv(cache, torch.cat([k[c:] for k, (c, _) in zip(ks, reqs)]),
                     torch.cat([v[c:] for v, (c, _) in zip(vs, reqs)]), batch)
    q_all = torch.cat(qs)
    qk = torch.cat([q_all, torch.randn(len(q_all), h_kv, d, generator=g)], dim=1)  # q as a strided view, as in the model
    out = backend.forward(qk[:, :h_q], cache, meta, d**-0.5)
    assert len(kernel_calls) == (1 if use_kernel else 0)  # one call for all
    for i, ((ctx, q), k, v, qq) in enumerate(zip(reqs, ks, vs, qs)):
        mask = torch.arange(ctx + q)[None, :] <= (ctx + torch.arange(q))[:, None]  # [q, ctx + q]
        kk = k.repeat_interleave(h_q // h_kv, dim=1).transpose(0, 1)  # [H_q, L, D]
        vv = v.repeat_interleave(h_q // h_kv, dim=1).transpose(0, 1)
        scores = (qq.transpose(0, 1) @ kk.transpose(1, 2)) * d**-0.5
        ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv  # [H_q, q, D]
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
