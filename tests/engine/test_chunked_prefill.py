"""Chunked prefill on the real model: greedy outputs identical to unchunked, with decodes and preemption mixed in."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a wooden press adapted from wine making. Books became cheaper, literacy "
        "spread, and ideas travelled faster than ever before across Europe. ")


def prompts_for(tok):
    ids = tok.encode(TEXT * 4)
    # lengths: 3+ chunks of 16, exact multiples of block_size (64, 48), odd lengths
    return [ids[:64], ids[:101], ids[:48], ids[:7]]


def test_chunked_matches_unchunked_including_tiny_budget_and_preemption(llm):
    tok = llm.get_tokenizer()
    prompts = prompts_for(tok)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref_engine = LLM(num_kv_blocks=256, enable_chunked_prefill=False)
    reference = [o.outputs[0].token_ids for o in ref_engine.generate(prompts, sp)]

    one_block = LLM(num_kv_blocks=256, max_num_batched_tokens=16)  # budget of a single block
    outs = one_block.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert one_block.llm_engine.stats.num_steps >= sum(len(p) for p in prompts) // 16
    assert_pool_clean(one_block.llm_engine)

    odd = LLM(num_kv_blocks=256, max_num_batched_tokens=37)  # chunks not aligned to blocks
    assert [o.outputs[0].token_ids for o in odd.generate(prompts, sp)] == reference

    starved = LLM(num_kv_blocks=10, max_num_batched_tokens=24)  # chunked + preemption together
    outs = starved.generate(prompts, sp)
    assert starved.llm_engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_clean(starved.llm_engine)


def test_long_prompt_arriving_among_running_decodes(llm):
    tok = llm.get_tokenizer()
    long_prompt = tok.encode(TEXT * 3)[:90]
    engine = LLM(num_kv_blocks=256, max_num_batched_tokens=20).llm_engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    running = [engine.add_request(p, sp) for p in ("Hello there!", "What is the time?")]
    engine.step()
    engine.step()
    counts = {rid: 2 for rid in running}  # one token from the prefill step, one from the decode step
    long_id = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        got = {o.request_id for o in outs}
        for rid in running:
            if rid not in finished:
                assert rid in got  # every running decode gets a token every step
        for o in outs:
            counts[o.request_id] = counts.get(o.request_id, 0) + 1
            if o.finished:
                finished[o.request_id] = o
    ref = LLM(num_kv_blocks=256, enable_chunked_prefill=False)
    expected = ref.generate(["Hello there!", "What is the time?", long_prompt],
                            [sp, sp, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert [finished[r].outputs[0].token_ids for r in running + [long_id]] == [
        o.outputs[0].token_ids for o in expected]


def test_priority_in_generate(llm):
    pr = LLM(num_kv_blocks=256, max_num_seqs=1, scheduling_policy="priority")
    outs = pr.generate(["First", "Second", "Third"], SamplingParams(temperature=0, max_tokens=2),
                       priority=[2, 0, 1])
    order = sorted(outs, key=lambda o: o.metrics.first_scheduled_time)
    assert [o.prompt for o in order] == ["Second", "Third", "First"]
