"""The start-up check (issue 41): the KV pool must hold one request of ``max_model_len`` tokens. An explicit
``max_model_len`` the pool cannot hold is refused, naming both numbers and the flags that fix it (vLLM refuses it
too); the default (the model's context) is lowered to the pool with a warning naming both numbers."""

import logging

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, derive_limits

BLOCK_BYTES = 1000  # a made-up block size in bytes: the check is pure arithmetic


def limits(**kw):
    return derive_limits(EngineConfig.from_kwargs(**kw), 8192, lambda dtype: BLOCK_BYTES)


def test_explicit_max_model_len_that_fits_is_kept():
    lim = limits(num_kv_blocks=64, block_size=16, max_model_len=1024)  # exactly 64 blocks
    assert (lim.max_model_len, lim.pool_tokens, lim.max_total_tokens) == (1024, 1024, 1024)


def test_explicit_max_model_len_one_token_over_the_pool_is_refused():
    with pytest.raises(ValueError) as e:
        limits(num_kv_blocks=64, block_size=16, max_model_len=1025)
    msg = str(e.value)
    assert "max_model_len=1025 tokens needs 65 KV blocks" in msg and "num_kv_blocks=64 (1024 tokens" in msg
    assert "--max-model-len to at most 1024" in msg and "--num-kv-blocks 65" in msg
    assert f"--kv-cache-memory-bytes {65 * BLOCK_BYTES}" in msg


def test_default_max_model_len_is_lowered_to_the_pool_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.config"):
        lim = limits(num_kv_blocks=64, block_size=16)
    assert (lim.max_model_len, lim.max_total_tokens) == (1024, 1024)
    (record,) = [r for r in caplog.records if r.name == "kvserve.config"]
    assert "lowered from the model's 8192 to 1024 tokens" in record.getMessage()


def test_default_max_model_len_that_fits_is_the_models_context(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.config"):
        lim = limits(num_kv_blocks=512, block_size=16)
    assert lim.max_model_len == 8192 and not caplog.records


def test_max_model_len_above_the_models_context_is_kept_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.config"):
        lim = limits(num_kv_blocks=1024, block_size=16, max_model_len=10000)
    assert lim.max_model_len == 10000
    (record,) = [r for r in caplog.records if r.name == "kvserve.config"]
    assert "max_model_len=10000 is above the model's context length (8192 tokens)" in record.getMessage()


def test_without_chunked_prefill_a_sequence_still_stops_at_the_token_budget():
    lim = limits(num_kv_blocks=64, block_size=16, max_model_len=1024, enable_chunked_prefill=False,
                 max_num_batched_tokens=512)
    assert (lim.max_model_len, lim.max_total_tokens) == (1024, 512)


@pytest.mark.real_model
def test_real_engine_refuses_and_lowers():
    """The default model (context 8192): 4 blocks of 16 tokens hold 64 tokens."""
    with pytest.raises(ValueError, match="max_model_len=128 tokens needs 8 KV blocks"):
        LLM(num_kv_blocks=4, block_size=16, max_model_len=128)
    llm = LLM(num_kv_blocks=4, block_size=16)
    assert llm.llm_engine.max_model_len == 64
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
