"""Shared fixtures. The real model loads once per test session (``load_model`` caches it in-process)."""

import pytest

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="session")
def llm():
    """The default SmolLM2-135M-Instruct engine (its Q4_1 weights kept quantized) with a roomy pool (512 blocks of
    16 tokens)."""
    return LLM(num_kv_blocks=512, max_num_seqs=32)


@pytest.fixture(scope="session")
def fp32_llm():
    """The same engine on the ``"fp32"`` path (weights dequantized at load): the one compared with
    ``transformers`` on the same float weights."""
    return LLM(num_kv_blocks=512, max_num_seqs=32, quantization="fp32")


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


def assert_pool_clean(engine):
    """Every block free, integrity invariants hold, nothing queued."""
    assert not engine.has_unfinished_requests()
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.block_pool.num_free_blocks == engine.num_blocks


def flat_batch(requests, block_size, logits_rows=None):
    """An ``InputBatch`` for raw requests ``[(token_ids, start_pos, block_table), ...]`` through the engine's own
    batch builder; logits of each request's last row, or of the flat rows ``logits_rows`` when given."""
    import torch

    from kvserve.core.sched_output import ScheduledRequest
    from kvserve.worker.input_batch import build_input_batch

    plan = [ScheduledRequest(str(i), list(ids), start, list(table), samples=True)
            for i, (ids, start, table) in enumerate(requests)]
    batch = build_input_batch(plan, block_size)
    if logits_rows is not None:
        batch.logits_indices = torch.as_tensor(logits_rows, dtype=torch.long)
    return batch
