"""Prefix caching on the real model: outputs identical with caching on and off."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant. Answer in one short sentence. Use plain words. Prefer facts over opinions. "
          "If you do not know, say so. Keep names and numbers exact. Never invent sources. ") * 3
QUESTIONS = ["What is the boiling point of water?", "Who wrote Hamlet?", "What is the largest ocean?"]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def build_prompts(tok):
    shared = tok.encode(SYSTEM)[:96]  # 6 full blocks of 16
    assert len(shared) == 96
    return [shared + tok.encode(q) for q in QUESTIONS] + [shared, shared[:80]]  # + exact multiples of 16


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_cached_outputs_match_uncached_including_full_hits(llm):
    prompts = build_prompts(llm.get_tokenizer())
    reference = tokens(LLM(num_kv_blocks=256, enable_prefix_caching=False).generate(prompts, SP))
    on = LLM(num_kv_blocks=256)
    assert tokens(on.generate(prompts, SP)) == reference  # same step: computed, then cached
    stats = on.llm_engine.stats
    assert stats.prefix_cache_hits == 0
    again = on.generate(prompts, SP)  # every shared block now hits
    assert tokens(again) == reference
    hits = on.llm_engine.kv_cache_manager.prefix_cache_hits
    # 3 questions x 96 + the 96-token prompt capped at 80 + the 80-token prompt capped at 64, plus output blocks
    assert hits >= 3 * 96 + 80 + 64
    assert 0 < on.llm_engine.kv_cache_manager.prefix_cache_hits <= on.llm_engine.kv_cache_manager.prefix_cache_queries
    assert_pool_clean(on.llm_engine)


def test_hits_after_eviction_pressure_and_after_a_stop_string(llm):
    tok = llm.get_tokenizer()
    prompts = build_prompts(tok)
    reference = tokens(LLM(num_kv_blocks=256, enable_prefix_caching=False).generate(prompts[:1], SP))
    small = LLM(num_kv_blocks=12)  # 192 slots: other prompts evict the cached prefix
    warm = small.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, stop=[" "]))[0]
    assert warm.outputs[0].finish_reason == "stop"  # warm-up ended on a stop string
    assert tokens(small.generate(prompts[:1], SP)) == reference
    assert small.llm_engine.kv_cache_manager.prefix_cache_hits >= 96
    for i in range(3):
        small.generate(tok.encode(f"Unrelated text number {i}. " * 12)[:120], SP)
    assert small.llm_engine.kv_cache_manager.block_pool.num_evictions > 0
    assert tokens(small.generate(prompts[:1], SP)) == reference
    small.llm_engine.kv_cache_manager.check_integrity()


@pytest.mark.slow
def test_preempted_requests_hit_and_outputs_match(llm):
    prompts = build_prompts(llm.get_tokenizer())[:3]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = tokens(LLM(num_kv_blocks=256, enable_prefix_caching=False).generate(prompts, sp))
    # each request ends at ~122 tokens = 8 blocks, 6 of them shared: 12 blocks for all three, 10 in the pool
    starved = LLM(num_kv_blocks=10, max_num_batched_tokens=64)
    outs = starved.generate(prompts, sp)
    engine = starved.llm_engine
    assert engine.stats.num_preemptions > 0 and engine.kv_cache_manager.prefix_cache_hits > 0
    assert tokens(outs) == reference
    assert_pool_clean(engine)
