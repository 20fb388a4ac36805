"""The CPU backend's one-call attention layer (``forward_qkv``: RoPE on q/k in place, the K/V write, paged attention
in ``csrc/paged_attention.c``) gives the same bits as the PyTorch ops it replaces (``AttentionBackend.forward_qkv``:
``apply_rotary``, ``write_kv``, then the same attention kernel), and the same values as gather + SDPA, for odd head
counts, GQA and MHA, head sizes with a scalar RoPE tail, queries across block edges and batches mixing decodes,
short spans and long prompt chunks. No model: random Q/K/V in a small pool."""

import pytest
import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.layers.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from kvserve.kernels import cpu as cpu_kernels
from tests.conftest import flat_batch, scattered_block_tables

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))

BATCHES = {
    # (tokens already in the cache, new query tokens) per request
    "decode-1": [(127, 1)],
    "decodes-at-block-edges": [(3, 1), (4, 1), (7, 1), (0, 1), (15, 1), (16, 1)],  # 8 decodes: whole-request tasks
    "mixed": [(9, 1), (13, 5), (7, 40), (31, 1), (2, 3)],  # decodes, short spans, a chunk with earlier context
    "prompts": [(0, 40), (0, 33), (0, 2)],  # fresh prompts: SDPA is_causal, plus a 2-token one on the kernel
}


def _setup(reqs, h_q, h_kv, d, bs, seed=0):
    """A pool with each request's earlier K/V written, the step's batch, and its fused qkv rows [T, (H_q+2H_kv)D]."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, 96, bs, h_kv, d)
    tables = scattered_block_tables(reqs, bs)
    for (ctx, _), table in zip(reqs, tables):
        if ctx:
            TorchSDPABackend().write_kv(cache, torch.randn(ctx, h_kv, d, generator=g),
                                        torch.randn(ctx, h_kv, d, generator=g), flat_batch([([0] * ctx, 0, table)], bs))
    batch = flat_batch([([0] * q, ctx, table) for (ctx, q), table in zip(reqs, tables)], bs)
    qkv = torch.randn(batch.num_tokens, (h_q + 2 * h_kv) * d, generator=g) * 2
    rope = rope_cos_sin(batch.positions, rope_inv_freq(d, 10000.0), torch.float32)
    return cache, batch, qkv, rope


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("h_q, h_kv, d, bs", [
    (9, 3, 64, 16),  # SmolLM2's heads
    (5, 5, 24, 4),  # MHA, odd heads; D/2 = 12: the RoPE loop's scalar tail
    (7, 1, 8, 5),  # one KV head for 7 query heads (MQA), the smallest D, block size 5
    (4, 2, 40, 16),
])
def test_fused_layer_equals_the_pytorch_ops_bit_for_bit(batch_name, h_q, h_kv, d, bs):
    reqs = BATCHES[batch_name]
    cache, batch, qkv, rope = _setup(reqs, h_q, h_kv, d, bs)
    fused_be, scale = CPUKernelAttentionBackend(), d**-0.5
    ref_cache, ref_qkv = cache.clone(), qkv.clone()
    meta = fused_be.build_metadata(batch)
    # the path the model took before: rotate with PyTorch ops, write_kv, then the backend's attention
    ref = AttentionBackend.forward_qkv(fused_be, ref_qkv, h_q, ref_cache, meta, rope, batch, scale)
    buf = torch.empty(batch.num_tokens, h_q * d)
    out = fused_be.forward_qkv(qkv, h_q, cache, meta, rope, batch, scale, buf)
    assert out.shape == (batch.num_tokens, h_q * d) and (out is buf) == (d % 8 == 0)  # written into the buffer
    assert torch.equal(cache, ref_cache)  # rotated keys and values in the same slots, same bits
    assert torch.equal(out, ref)
    # the queries and keys were rotated in place, equal to apply_rotary's
    qk = apply_rotary(ref_qkv[:, : (h_q + h_kv) * d].view(-1, h_q + h_kv, d), *rope)
    assert torch.equal(qkv[:, : (h_q + h_kv) * d], qk.reshape(batch.num_tokens, -1))
    # and the same values as the gather + SDPA reference backend
    sdpa_cache = ref_cache.clone()
    sdpa = TorchSDPABackend()
    expect = sdpa.forward_qkv(ref_qkv.clone(), h_q, sdpa_cache, sdpa.build_metadata(batch), rope, batch, scale)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)


def test_kernel_runs_once_per_layer_for_every_request_long_chunks_included(monkeypatch):
    cache, batch, qkv, rope = _setup(BATCHES["mixed"], 9, 3, 64, 16)
    be = CPUKernelAttentionBackend()
    meta = be.build_metadata(batch)
    assert meta.groups == [] and meta.whole_step_in_kernel  # the 40-token chunk too: no SDPA group
    assert meta.kernel[2].tolist() == [1, 5, 40, 1, 3]
    calls = []
    real = cpu_kernels._lib.kvserve_rope_write_attend_f32_avx2
    monkeypatch.setattr(cpu_kernels, "_lib", type("L", (), {
        "kvserve_rope_write_attend_f32_avx2": staticmethod(lambda *a: calls.append(a[13]) or real(*a))})())
    be.forward_qkv(qkv, 9, cache, meta, rope, batch, 0.125)
    assert calls == [5]  # one call attending all five requests


def test_decode_step_uses_the_batch_tensors_without_copies():
    _, batch, _, _ = _setup(BATCHES["decodes-at-block-edges"], 9, 3, 64, 16)
    meta = CPUKernelAttentionBackend().build_metadata(batch)
    tables, q_start, q_len, seq_len = meta.kernel
    assert meta.groups == [] and tables.data_ptr() == batch.block_tables.data_ptr()
    assert q_start.tolist() == list(range(6)) and q_len.tolist() == [1] * 6
    assert seq_len.tolist() == [4, 5, 8, 1, 16, 17]


def test_scratch_failure_is_an_error_not_a_fallback(monkeypatch):
    """The kernel's attention step reports -1 (no scratch memory): the backend raises, it does not quietly attend
    another way."""
    cache, batch, qkv, rope = _setup(BATCHES["mixed"], 9, 3, 64, 16)
    be = CPUKernelAttentionBackend()
    meta = be.build_metadata(batch)

    def no_scratch(*a):
        return -1

    monkeypatch.setattr(cpu_kernels, "_lib", type("L", (), {
        "kvserve_rope_write_attend_f32_avx2": staticmethod(no_scratch)})())
    with pytest.raises(MemoryError, match="scratch memory"):
        be.forward_qkv(qkv, 9, cache, meta, rope, batch, 0.125)


def test_a_head_width_the_kernel_cannot_take_gets_the_reference_backend_once():
    """D = 12 (not a multiple of 8): the model is given the reference backend when it is built (``for_head_dim``);
    handing such tensors to the kernel backend anyway is an error, not a per-call fallback."""
    cache, batch, qkv, rope = _setup(BATCHES["mixed"], 6, 2, 12, 4)
    plan = cpu_kernels.RopeWriteAttend(6, cache.shape, cache.dtype, *rope, batch.slot_mapping, None, 1.0)
    assert not plan.ok and plan(qkv, cache) is None
    be = CPUKernelAttentionBackend()
    assert be.for_head_dim(64) is be and isinstance(be.for_head_dim(12), TorchSDPABackend)
    assert not isinstance(be.for_head_dim(12), CPUKernelAttentionBackend)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        be.forward_qkv(qkv, 6, cache, be.build_metadata(batch), rope, batch, 12**-0.5)


def test_the_avx512_build_hands_a_head_width_of_8_times_odd_to_the_avx2_build():
    """The AVX-512 build takes D in multiples of 16; D = 24 gets the AVX2 build (one decision per model), D = 64
    stays; an unknown build name is a clear error."""
    for build in ("avx512", "amx"):  # the AMX build takes the AVX-512 build's widths (D = 16 via a padded copy)
        be = CPUKernelAttentionBackend(build)
        assert be.for_head_dim(64) is be and be.for_head_dim(16) is be
        assert be.for_head_dim(24).isa == "avx2" and isinstance(be.for_head_dim(12), TorchSDPABackend)
    with pytest.raises(ValueError, match="isa must be one of"):
        CPUKernelAttentionBackend("sse2")


@pytest.mark.parametrize("h_q, h_kv, d, ctx", [(9, 3, 64, 127), (5, 5, 24, 13), (8, 1, 32, 8), (6, 2, 128, 300)])
def test_decode_rows_equal_the_same_row_of_a_longer_query_bit_for_bit(h_q, h_kv, d, ctx):
    """A row's result does not depend on how many query rows its request has: a decode at position ``ctx`` equals,
    bit for bit, the last row of a 2-token query ending there, over the same keys and values."""
    g = torch.Generator().manual_seed(3)
    bs = 16
    n_blocks = -(-(ctx + 1) // bs)
    cache = torch.randn(2, 2 * n_blocks, bs, h_kv, d, generator=g)
    cache[:, n_blocks:] = cache[:, :n_blocks]  # request 1's blocks hold the same K/V as request 0's
    q = torch.randn(3, h_q, d, generator=g)
    q[2] = q[0]  # request 1's last row is request 0's decode row
    tables = torch.tensor([list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))])
    as_long = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    out = torch.full((3, h_q, d), float("nan"))
    assert cpu_kernels.paged_attention(q, cache, tables, as_long(0, 1), as_long(1, 2), as_long(ctx + 1, ctx + 1),
                                       d**-0.5, out)
    assert torch.equal(out[0], out[2]) and torch.isfinite(out).all()
