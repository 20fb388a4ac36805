"""Speculative decoding (n-gram proposer) on the real model: greedy output identical to no speculation."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.policy import VERIFY_COST_PER_TOKEN
from tests.conftest import assert_pool_clean
from tests.engine.spec_common import greedy_reference_and_single, prompts

pytestmark = pytest.mark.real_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(num_kv_blocks=128, block_size=16, speculative_config=SPEC)


def test_greedy_identical_batch_one_and_mixed(llm, spec_llm):
    ps = prompts(spec_llm)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = greedy_reference_and_single(llm, spec_llm, ps, sp)
    stats = spec_llm.llm_engine.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.mean_accepted_length > 1.0
    # mixed batch: speculating greedy requests next to sampled (seeded and unseeded) ones that do not draft
    mixed_params = [sp, SamplingParams(temperature=0.8, max_tokens=20, seed=3), sp,
                    SamplingParams(temperature=1.0, max_tokens=10, repetition_penalty=1.2)]
    mixed = spec_llm.generate(ps, mixed_params)
    assert mixed[0].outputs[0].token_ids == reference[0]
    assert mixed[2].outputs[0].token_ids == reference[2]
    assert_pool_clean(spec_llm.llm_engine)


def test_near_max_tokens_and_block_boundaries(llm, spec_llm):
    ps = prompts(spec_llm)[:1]
    for max_tokens in (1, 2, 6, 17):  # drafts shrink near max_tokens; rollback across block edges
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ref = llm.generate(ps, sp)[0].outputs[0].token_ids
        got = spec_llm.generate(ps, sp)[0].outputs[0]
        assert got.token_ids == ref and len(got.token_ids) == max_tokens
        spec_llm.llm_engine.kv_cache_manager.check_integrity()
    assert_pool_clean(spec_llm.llm_engine)


def test_seeded_sampling_reproducible_with_speculation(spec_llm):
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=42)
    p = prompts(spec_llm)[0]
    a = spec_llm.generate(p, sp)[0].outputs[0].text
    b = spec_llm.generate([p, "Hello"], [sp, SamplingParams(temperature=0, max_tokens=8)])[0].outputs[0].text
    assert a == b


@pytest.mark.slow
def test_starved_pool_with_speculation(llm):
    ps = prompts(llm)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    starved = LLM(num_kv_blocks=9, block_size=16, speculative_config=SPEC)
    outs = starved.generate(ps, sp)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert starved.llm_engine.stats.num_preemptions > 0
    assert_pool_clean(starved.llm_engine)


def test_bad_speculative_config():
    for cfg, field in (({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ({"bogus": 1}, "bogus")):
        with pytest.raises(ValueError, match=field):
            LLM(num_kv_blocks=8, speculative_config=cfg)


@pytest.mark.slow
def test_held_back_drafts_do_not_change_output(llm, spec_llm):
    # A step cost model where a verified token costs as much as the whole step (c = 1: break-even acceptance
    # 0.89 at batch 8): drafts are mostly held back and shadow-checked instead of verified; output unchanged.
    ps = prompts(spec_llm) + ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "List three animals."]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    policy = spec_llm.llm_engine.speculator.policy
    held_before = policy.num_held_back
    policy.verify_cost_per_token = 1.0
    try:
        assert [o.outputs[0].token_ids for o in spec_llm.generate(ps, sp)] == reference
    finally:
        policy.verify_cost_per_token = VERIFY_COST_PER_TOKEN
    assert policy.num_held_back > held_before
    assert_pool_clean(spec_llm.llm_engine)


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"


@pytest.mark.parametrize("stop, max_tokens", [(["5"], 8), ([" 7,"], 20)])
def test_a_stop_string_inside_accepted_drafts_ends_the_request_at_its_token(llm, spec_llm, stop, max_tokens):
    # The counting prompt makes n-gram drafts accepted in runs: the token that completes the stop string arrives
    # mid-way through a multi-token step. It must be the last token kept, exactly as without speculation.
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
    ref = llm.generate(COUNTING, sp)[0].outputs[0]
    before = spec_llm.llm_engine.stats.generation_tokens
    drafts_before = spec_llm.llm_engine.speculator.stats.num_accepted_tokens
    out = spec_llm.generate(COUNTING, sp)[0].outputs[0]
    assert spec_llm.llm_engine.speculator.stats.num_accepted_tokens > drafts_before  # drafts were accepted
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        ref.text, ref.token_ids, "stop", stop[0])
    assert spec_llm.llm_engine.stats.generation_tokens - before == len(ref.token_ids)
    assert_pool_clean(spec_llm.llm_engine)
