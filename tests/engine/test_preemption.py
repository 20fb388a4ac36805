"""Preemption by recompute on the real model: a starved pool gives the same greedy outputs as a roomy one."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three colors.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What is 2 + 2?",
    "Describe a cat in one sentence.",
    "What is an atom?",
]


@pytest.mark.slow
def test_starved_pool_preempts_and_outputs_are_unchanged(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert llm.llm_engine.stats.num_preemptions == 0

    starved = LLM(num_kv_blocks=24, block_size=16, max_num_seqs=8)  # 384 slots for 8 x ~75 tokens
    outs = starved.generate(prompts, sp)
    engine = starved.llm_engine
    assert engine.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == engine.stats.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert engine.stats.peak_used_blocks <= 24
    assert_pool_clean(engine)


def test_request_growing_past_the_pool_finishes_with_length():
    """A lone request may not grow beyond what the whole pool holds: it ends with finish_reason 'length'."""
    small = LLM(num_kv_blocks=2, block_size=16)
    out = small.generate("Tell me a long story about dragons.", SamplingParams(temperature=0, max_tokens=100,
                                                                                ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert_pool_clean(small.llm_engine)
