"""n > 1 parallel sampling on the real model: one prefill, shared prompt blocks, copy-on-write."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model


def test_greedy_samples_all_equal_greedy_output(llm):
    p = llm.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    greedy = llm.generate(p, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, n=3))[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == greedy.token_ids and c.text == greedy.text for c in out.outputs)
    assert_pool_clean(llm.llm_engine)


def test_seeded_samples_differ_reproduce_and_match_single_requests():
    llm = LLM(num_kv_blocks=64)
    tok = llm.get_tokenizer()
    p = llm.apply_chat_template([{"role": "user", "content": "Write a word."}])
    assert len(tok.encode(p)) % 16 != 0  # the prompt's last block is partial: the samples share it, then copy
    sp = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=11)
    a = llm.generate(p, sp)[0]
    engine = llm.llm_engine
    per_seq = -(-(len(tok.encode(p)) + 12) // 16)
    assert engine.stats.peak_used_blocks < 4 * per_seq  # the prompt's blocks are held once, not four times
    b = llm.generate(p, sp)[0]
    samples = [c.token_ids for c in a.outputs]
    assert samples == [c.token_ids for c in b.outputs]  # reproducible
    assert len({tuple(s) for s in samples}) > 1  # and different from each other
    # sample i is exactly what a single request seeded with seed + i produces: the copied K/V is right
    singles = llm.generate([p] * 4, [SamplingParams(temperature=1.0, max_tokens=12, seed=11 + i) for i in range(4)])
    assert samples == [o.outputs[0].token_ids for o in singles]
    assert_pool_clean(engine)


def test_parallel_sampling_with_preemption_and_abort():
    llm = LLM(num_kv_blocks=8, max_num_seqs=4)
    p = llm.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=3)
    out = llm.generate(p, sp)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert llm.llm_engine.stats.num_preemptions > 0
    assert_pool_clean(llm.llm_engine)
    engine = llm.llm_engine
    rid = engine.add_request(p, SamplingParams(max_tokens=30, n=2))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    assert_pool_clean(engine)


def test_parallel_sampling_with_logprobs(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=1,
                                                                  logprobs=2))[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 4
        assert all(t in e for t, e in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == sum(e[t] for e, t in zip(c.logprobs, c.token_ids))
