"""``kv_cache_dtype`` under tensor parallelism, in its own module: it needs its own T=2 engine, and a process holds
one tensor-parallel engine at a time (test_tensor_parallel.py's module-scoped pair is gone by the time this runs)."""

import pytest
import torch

from kvserve.distributed.worker import forward_plan
from kvserve.engine.llm_engine import LLMEngine
from tests.distributed.test_tensor_parallel import ENGINE, PROMPTS, _generate, _plan, tiny_llama  # noqa: F401


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_a_narrow_kv_cache_on_every_rank(tiny_llama, kv_dtype):
    """``kv_cache_dtype`` travels to the workers (``ShardSpec``): T=2 over bfloat16 or int8 pools decodes as T=1 over
    one, and the logits stay within the float32 test's tolerance of T=1's, which they would not if one rank kept a
    float32 pool (its half of the heads would differ by the rounding). An int8 pool's scales are per (token, KV
    head), so a rank holding half the heads stores the same rows as one process holding all."""
    one = LLMEngine.from_engine_args(model=tiny_llama, kv_cache_dtype=kv_dtype, **ENGINE)
    two = LLMEngine.from_engine_args(model=tiny_llama, tensor_parallel_size=2, kv_cache_dtype=kv_dtype, **ENGINE)
    try:
        assert two.model_runner.spec.kv_cache_dtype == kv_dtype
        assert two.model_runner.runner.kv_cache.dtype == one.model_runner.kv_cache.dtype == getattr(torch, kv_dtype)
        assert _generate(two, PROMPTS) == _generate(one, PROMPTS)
        plan = _plan(block_base=40)
        ref = forward_plan(one.model, one.model_runner.kv_cache, plan, one.block_size)
        got = two.model_runner.compute_logits(plan)
        assert torch.allclose(got, ref, rtol=0, atol=1e-4), (got - ref).abs().max()
    finally:
        two.shutdown()
