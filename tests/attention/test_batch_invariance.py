"""``batch_invariant=True`` on the default quantized model: a token's logprobs are bit-identical whether its
prompt ran in one step or in chunks, after a prefix-cache hit, or beside other requests (the kernel reads every
query; quantized matmuls, norms and RoPE are row-wise). Without it long chunks use SDPA, whose float order differs
by ~1e-7, which int8 activation rounding can amplify (see kvserve/attention/cpu.py)."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4 + "Once upon a time, in a land far away, there lived a"
OTHERS = ["Write a haiku about the sea.", "List three prime numbers: 2, 3,"]


def _llm(monkeypatch, **kw):
    llm = LLM(quantization="auto", num_kv_blocks=96, batch_invariant=True, **kw)
    assert llm.llm_engine.model_runner.model.attn.batch_invariant
    return llm


def _run(llm, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, **kw)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in llm.generate(prompts, sp)]


def test_chunking_prefix_hits_and_batch_mates_change_nothing(monkeypatch):
    one_step = _llm(monkeypatch, enable_prefix_caching=True)
    ref = _run(one_step, [PROMPT], prompt_logprobs=1)[0]
    assert len(ref[2]) > 40  # one prefill step of every prompt token (> SHORT_QUERY_TOKENS: SDPA by default)
    again = _run(one_step, [PROMPT])[0]  # the prompt's full blocks now come from the prefix cache
    assert one_step.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert again[:2] == ref[:2]
    mixed = _run(one_step, [OTHERS[0], PROMPT + " king", OTHERS[1]])  # shares the prefix, other requests beside
    alone = _run(one_step, [PROMPT + " king"])[0]
    assert mixed[1][:2] == alone[:2]
    assert_pool_clean(one_step.llm_engine)
    del one_step
    chunked = _llm(monkeypatch, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _run(chunked, [PROMPT], prompt_logprobs=1)[0] == ref  # tokens, logprobs and prompt logprobs, exactly


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_variable_is_the_fields_default(monkeypatch, value, expected):
    from kvserve.config import KernelConfig

    monkeypatch.setenv("KVSERVE_BATCH_INVARIANT", value)
    assert KernelConfig().batch_invariant is expected
    assert KernelConfig(batch_invariant=not expected).batch_invariant is (not expected)  # the argument wins


def test_a_bad_variable_names_itself(monkeypatch):
    from kvserve.config import KernelConfig

    monkeypatch.setenv("KVSERVE_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match=r"\$KVSERVE_BATCH_INVARIANT must be 1 or 0"):
        KernelConfig()
