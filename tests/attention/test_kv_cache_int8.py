"""An int8 KV cache (``kv_cache_dtype="int8"``; ``kvserve.attention.kv_layout``): each (token, KV head) row is D
int8 values then a bfloat16 scale. Quantizing and dequantizing round-trip within half a step, re-quantizing what was
read gives the same bytes, the C kernels' K/V write stores exactly PyTorch's bytes, attention over an int8 cache
equals the float32 kernel over the dequantized values bit for bit (both instruction-set builds), and the PyTorch
reference path reads and writes the same cache. No model: random Q/K/V in a small pool."""

import pytest
import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.kv_layout import dequantize_int8, head_dim, pool_bytes, pool_shape, quantize_int8
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from tests.attention.test_fused_attention import BATCHES, _setup

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))

I8 = torch.int8


def _isas():
    return cpu_kernels.attention_isas()


def _rows(n=64, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())


def test_layout_shapes_and_bytes():
    assert pool_shape((30, 2, 8, 16, 3, 64), I8) == (30, 2, 8, 16, 3, 66)
    assert pool_shape((30, 2, 8, 16, 3, 64), torch.bfloat16) == (30, 2, 8, 16, 3, 64)
    # SmolLM2-135M's block: 30 layers x K, V x 16 tokens x 3 heads x (64 values + 2 scale bytes)
    assert pool_bytes((30, 2, 1, 16, 3, 64), I8) == 30 * 2 * 16 * 3 * 66 == 190_080
    assert pool_bytes((30, 2, 1, 16, 3, 64), torch.bfloat16) / pool_bytes((30, 2, 1, 16, 3, 64), I8) >= 1.9
    assert head_dim(torch.zeros(2, 1, 16, 3, 66, dtype=I8)) == 64 == head_dim(torch.zeros(2, 1, 16, 3, 64))


def test_round_trip_is_within_half_a_step_and_requantizing_is_exact():
    x = _rows()
    rows = quantize_int8(x)
    assert rows.shape == (64, 66) and rows.dtype == I8
    q, s = rows[:, :64].float(), rows[:, 64:].contiguous().view(torch.bfloat16).float()
    assert q.abs().max() == 127 and (q.abs().amax(1) == 127).all()  # every row uses the full range
    # the scale is bfloat16(max|x| / 127), and the error of every value at most half a step
    assert torch.equal(s[:, 0], (x.abs().amax(1) / 127).to(torch.bfloat16).float())
    y = dequantize_int8(rows)
    assert ((y - x).abs() <= s / 2 * (1 + 2**-8)).all()  # ties and the clamp of a rounded-down scale
    assert torch.equal(y, q * s)  # exact products
    assert torch.equal(quantize_int8(y), rows)  # what was read quantizes to the same bytes


def test_special_rows():
    x = torch.zeros(5, 16)
    x[1, 3] = 1.0  # one value: q = 127 there, the scale bfloat16(1 / 127)
    x[2, :7] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5])  # scale exactly 1: halves round to even
    x[3, 0] = float("nan")
    x[4, 5] = float("inf")
    rows = quantize_int8(x)
    assert (rows[0] == 0).all()  # a zero row: zero values and scale 0
    assert rows[1, 3] == 127 and rows[1, :16].abs().sum() == 127
    assert rows[1, 16:].view(torch.bfloat16).item() == torch.tensor(1 / 127).to(torch.bfloat16).item()
    assert rows[2, 16:].view(torch.bfloat16).item() == 1.0
    assert rows[2, :7].tolist() == [127, 0, 2, 2, 0, -2, 126]
    s1 = torch.tensor(1 / 127).to(torch.bfloat16).float()
    assert torch.equal(dequantize_int8(rows[:3]).abs().amax(1), torch.stack([0 * s1, 127 * s1, 127 + 0 * s1]))
    out = dequantize_int8(rows[3:])
    assert out.isnan().all() and (rows[3:, :16] == 0).all()  # NaN or infinity: the whole row reads as NaN


def _write_through_kernel(values: torch.Tensor, isa: str) -> torch.Tensor:
    """``values [T, D]`` written as value heads (no rotation) by the fused kernel into an int8 cache: the rows."""
    t, d = values.shape
    qkv = torch.zeros(t, 3 * d)
    qkv[:, 2 * d:] = values
    qkv[:, d: 2 * d] = values  # and as keys: cos 1, sin 0 leaves them as they are
    cache = torch.zeros(pool_shape((2, 8, 16, 1, d), I8), dtype=I8)
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(3))[:t]
    plan = cpu_kernels.RopeWriteAttend(1, cache.shape, I8, torch.ones(t, d), torch.zeros(t, d), slots, None, 1.0,
                                       isa)
    assert plan.ok and plan(qkv, cache) is not None
    k, v = cache[0].view(-1, d + 2)[slots], cache[1].view(-1, d + 2)[slots]
    assert torch.equal(k, v)
    return v


@pytest.mark.parametrize("isa", _isas())
def test_the_kernels_write_stores_pytorchs_bytes(isa):
    x = _rows(96, 64, seed=1)
    x[0] = 0.0
    x[1] = torch.linspace(-127, 127, 64)  # scale 1.0: every value an integer
    x[2, :32] = torch.arange(32) + 0.5  # ties, both ways of even
    x[3] *= 1e-39  # subnormal magnitudes: scale rounds to 0 or a subnormal
    x[4] *= 1e30
    rows = _write_through_kernel(x, isa)
    assert torch.equal(rows, quantize_int8(x))
    bad = torch.zeros(2, 64)
    bad[0, 7], bad[1, 9] = float("nan"), -float("inf")
    got = dequantize_int8(_write_through_kernel(bad, isa))
    assert got.isnan().all()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("h_q, h_kv, d, bs", [(9, 3, 64, 16), (4, 4, 32, 4), (7, 1, 16, 5)])
def test_int8_cache_equals_the_float32_kernel_over_the_dequantized_values(isa, batch_name, h_q, h_kv, d, bs):
    """The same step over an int8 pool and over a float32 pool that holds the dequantized values (the earlier
    context, and this step's K/V quantized as the kernel stores them): the same output bits and the same stored
    values."""
    if d % cpu_kernels.ATTENTION_ISAS[isa]:
        pytest.skip(f"D={d} is not a multiple of {isa}'s width")
    cache32, batch, qkv, rope = _setup(BATCHES[batch_name], h_q, h_kv, d, bs)
    cache8 = quantize_int8(cache32)
    cache32 = dequantize_int8(cache8)
    be, scale = CPUKernelAttentionBackend(isa), d**-0.5
    out8 = be.forward_qkv(qkv.clone(), h_q, cache8, be.build_metadata(batch), rope, batch, scale)
    out32 = AttentionBackend.forward_qkv(_QuantizingBackend(isa), qkv.clone(), h_q, cache32,
                                         be.build_metadata(batch), rope, batch, scale)
    assert torch.equal(dequantize_int8(cache8), cache32)
    assert torch.equal(out8.view(torch.int32), out32.view(torch.int32))
    # the unfused entry point (paged_attention) over both caches as they now are
    q = torch.randn(batch.num_tokens, h_q, d, generator=torch.Generator().manual_seed(5))
    a, b = (be.forward(q, c, be.build_metadata(batch), scale) for c in (cache8, cache32))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


class _QuantizingBackend(CPUKernelAttentionBackend):
    """The CPU backend over a float32 cache that holds int8-dequantized values (what an int8 cache reads as)."""

    def write_kv(self, kv_cache, k, v, batch):
        super().write_kv(kv_cache, dequantize_int8(quantize_int8(k)), dequantize_int8(quantize_int8(v)), batch)


@pytest.mark.parametrize("batch_name", ["mixed", "prompts", "decodes-at-block-edges"])
def test_the_pytorch_path_reads_and_writes_the_same_int8_cache(batch_name):
    cache, batch, qkv, rope = _setup(BATCHES[batch_name], 9, 3, 64, 16)
    cache_k, cache_s = quantize_int8(cache), quantize_int8(cache)
    kernel = CPUKernelAttentionBackend()
    out_k = kernel.forward_qkv(qkv.clone(), 9, cache_k, kernel.build_metadata(batch), rope, batch, 0.125)
    sdpa = TorchSDPABackend()
    out_s = sdpa.forward_qkv(qkv.clone(), 9, cache_s, sdpa.build_metadata(batch), rope, batch, 0.125)
    assert torch.equal(cache_k, cache_s)
    torch.testing.assert_close(out_k, out_s, rtol=1e-4, atol=1e-5)


def test_a_cache_without_its_scale_bytes_is_declined():
    """An int8 tensor whose rows are D wide (no scales) is not an int8 pool: both entry points refuse it."""
    cache, batch, qkv, rope = _setup(BATCHES["decode-1"], 9, 3, 64, 16)
    bare = torch.zeros(cache.shape, dtype=I8)
    meta = CPUKernelAttentionBackend().build_metadata(batch)
    out = torch.full((batch.num_tokens, 9, 64), 7.0)
    assert not cpu_kernels.paged_attention(qkv[:, : 9 * 64].view(-1, 9, 64), bare, *meta.kernel, 0.125, out)
    assert (out == 7.0).all()
