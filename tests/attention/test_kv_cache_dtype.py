"""A bfloat16 KV cache (``kv_cache_dtype="bfloat16"``) in the CPU attention kernels (csrc/paged_attention_kv.h):
the K/V write rounds exactly as PyTorch's float32 -> bfloat16 cast (ties to even, infinities, subnormals; NaN stays
NaN), and
attention over a bfloat16 cache equals, bit for bit, the float32 kernel over the same values widened to float32
(widening is exact and the arithmetic the same), so the only change a bfloat16 cache makes is the rounding of what
is stored. The PyTorch path (``write_kv`` + gather + SDPA) takes the same cache and agrees. No model: random
Q/K/V in a small pool."""

import pytest
import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUKernelAttentionBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.kernels import cpu as cpu_kernels
from tests.attention.test_fused_attention import BATCHES, _setup

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))

BF16 = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_the_kernels_write_rounds_as_pytorchs_cast_bit_for_bit():
    """Value heads are stored without rotation, so every float32 bit pattern below reaches the rounding as is:
    halfway cases both ways (ties to even), the largest values that round to infinity, NaN, infinities, signed
    zeros and subnormals, and random values across the exponent range."""
    h_q, h_kv, d, bs = 1, 1, 64, 16
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0x7FC00001,
                            0xFFC00000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,
                            0x00008000, 0x00018000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    t = 8
    qkv = torch.randn(t, (h_q + 2 * h_kv) * d, generator=g)
    values = torch.randn(t, d, generator=g) * torch.exp2(torch.randint(-130, 120, (t, d), generator=g).float())
    values.view(-1)[: special.numel()] = special
    qkv[:, (h_q + h_kv) * d:] = values
    cache = torch.zeros(2, 4, bs, h_kv, d, dtype=BF16)
    slots = torch.tensor([3, 0, 17, 9, 40, 63, 21, 5])
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    plan = cpu_kernels.RopeWriteAttend(h_q, cache.shape, BF16, cos, sin, slots, None, 1.0)
    assert plan.ok and plan(qkv, cache) is not None
    stored, expect = cache[1].view(-1, h_kv * d)[slots], values.to(BF16)
    nan = values.isnan()
    assert int(nan.sum()) == 2 and stored[nan].isnan().all()  # NaN stays NaN (PyTorch's own payloads vary by path)
    assert torch.equal(_bits(stored[~nan]), _bits(expect[~nan]))


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("h_q, h_kv, d, bs", [(9, 3, 64, 16), (5, 5, 24, 4), (7, 1, 8, 5)])
def test_bf16_cache_equals_the_float32_kernel_over_the_widened_values(batch_name, h_q, h_kv, d, bs):
    cache32, batch, qkv, rope = _setup(BATCHES[batch_name], h_q, h_kv, d, bs)
    cache16 = cache32.to(BF16)
    cache32 = cache16.float()  # the earlier context: the same values in both
    be, scale = CPUKernelAttentionBackend(), d**-0.5
    meta16, meta32 = be.build_metadata(batch), be.build_metadata(batch)
    qkv16, qkv32 = qkv.clone(), qkv.clone()
    out16 = be.forward_qkv(qkv16, h_q, cache16, meta16, rope, batch, scale)
    # the float32 reference: this step's K/V rounded to bfloat16 as the kernel stores them, then the f32 kernel
    out32 = AttentionBackend.forward_qkv(_RoundingBackend(), qkv32, h_q, cache32, meta32, rope,
                                         batch, scale)
    assert torch.equal(_bits(cache16), _bits(cache32.to(BF16)))  # the same stored values
    assert torch.equal(out16.view(torch.int32), out32.view(torch.int32))


class _RoundingBackend(CPUKernelAttentionBackend):
    """The CPU backend over a float32 cache that holds bfloat16-rounded values (what a bfloat16 cache stores)."""

    def write_kv(self, kv_cache, k, v, batch):
        super().write_kv(kv_cache, k.to(BF16).float(), v.to(BF16).float(), batch)


@pytest.mark.parametrize("batch_name", ["mixed", "prompts", "decodes-at-block-edges"])
def test_the_pytorch_path_takes_a_bf16_cache_and_agrees(batch_name):
    """``write_kv`` casts float32 keys to the cache's dtype and SDPA widens the gathered blocks: the reference
    backend over a bfloat16 cache gives the kernel's values (to float32 summation order) and the same cache."""
    cache, batch, qkv, rope = _setup(BATCHES[batch_name], 9, 3, 64, 16)
    cache_k, cache_s = cache.to(BF16), cache.to(BF16)
    kernel = CPUKernelAttentionBackend()
    out_k = kernel.forward_qkv(qkv.clone(), 9, cache_k, kernel.build_metadata(batch), rope, batch, 0.125)
    sdpa = TorchSDPABackend()
    out_s = sdpa.forward_qkv(qkv.clone(), 9, cache_s, sdpa.build_metadata(batch), rope, batch, 0.125)
    assert torch.equal(_bits(cache_k), _bits(cache_s))
    torch.testing.assert_close(out_k, out_s, rtol=1e-4, atol=1e-5)


def test_a_cache_of_another_dtype_is_declined():
    """float16 is neither kernel's type: the plan is not ``ok`` and ``paged_attention`` writes nothing."""
    cache, batch, qkv, rope = _setup(BATCHES["decode-1"], 9, 3, 64, 16)
    half = cache.to(torch.float16)
    plan = cpu_kernels.RopeWriteAttend(9, half.shape, torch.float16, *rope, batch.slot_mapping, None, 1.0)
    assert not plan.ok and plan(qkv, half) is None
    meta = CPUKernelAttentionBackend().build_metadata(batch)
    out = torch.full((batch.num_tokens, 9, 64), 7.0)
    assert not cpu_kernels.paged_attention(qkv[:, : 9 * 64].view(-1, 9, 64), half, *meta.kernel, 0.125, out)
    assert (out == 7.0).all()
