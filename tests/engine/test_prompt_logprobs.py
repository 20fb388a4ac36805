"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the real model: every value equals the log-softmax of a
direct one-pass forward over the whole prompt (within 1e-4), whether the prompt ran in one step, in chunks, after
a prefix-cache hit of an earlier request, or after a preemption by recompute in the middle of its prompt."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from benchmarks.accuracy import all_logits
from tests.conftest import assert_pool_clean

TOL = 1e-4
PREFIX = ("You are a careful assistant. Answer in one short sentence. Use plain words. Keep names and numbers "
          "exact. ") * 3


@pytest.fixture(scope="module")
def reference(llm):
    """ids -> ``[len(ids), V]`` log-softmax of one direct forward over all positions (the engine's model, a private
    cache of the engine's KV dtype, every row's logits)."""
    model, kv_dtype = llm.llm_engine.model_runner.model, llm.llm_engine.kv_cache_dtype

    def ref(ids):
        with torch.inference_mode():
            return all_logits(model, ids, kv_dtype).log_softmax(-1)
    return ref


def check(entries: list, ids: list, ref: torch.Tensor, k: int, ranks: list = None) -> None:
    """vLLM's shape (``None`` first, then the prompt token + the top ``k``) and each value within ``TOL``; each
    prompt token's ``rank`` (``RequestOutput.prompt_logprob_ranks``) between the reference's count of logprobs
    above its own by more than ``TOL`` and of those within ``TOL`` of it or above."""
    assert len(entries) == len(ids) and entries[0] is None
    if ranks is not None:
        assert len(ranks) == len(ids) and ranks[0] is None
    for pos, (entry, token) in enumerate(zip(entries[1:], ids[1:])):
        row = ref[pos]
        if ranks is not None:
            lp = float(row[token])
            assert int((row > lp + TOL).sum()) + 1 <= ranks[pos + 1] <= int((row >= lp - TOL).sum()), (pos, ranks)
        top = row.topk(k).indices.tolist()
        assert token in entry and set(top) <= set(entry) and len(entry) <= k + 1
        assert list(entry)[:k] == top  # top-k first, most likely first
        for t, lp in entry.items():
            assert abs(lp - float(row[t])) < TOL, (pos, t, lp, float(row[t]))


def test_one_step_batched_and_forks_match_a_direct_forward(llm, reference, monkeypatch):
    monkeypatch.setattr("kvserve.worker.prompt_logprobs.ROWS_PER_PASS", 5)  # log-softmax in several passes
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is Paris, and the capital of Germany is", "Once upon a time"]
    ids = [tok.encode(p) for p in prompts]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                                  SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, n=2)])
    check(outs[0].prompt_logprobs, ids[0], reference(ids[0]), 3, outs[0].prompt_logprob_ranks)
    check(outs[1].prompt_logprobs, ids[1], reference(ids[1]), 0, outs[1].prompt_logprob_ranks)  # 0: own only
    assert max(outs[0].prompt_logprob_ranks[1:]) > 3  # ranks counted beyond the top k too
    assert all(len(e) == 1 for e in outs[1].prompt_logprobs[1:])
    # generation is unchanged by scoring the prompt; requests without it report None
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert outs[1].outputs[1].token_ids == plain[1].outputs[0].token_ids
    assert plain[0].prompt_logprobs is None
    assert_pool_clean(llm.llm_engine)


@pytest.fixture(scope="module")
def small():
    """A 6-block pool (96 slots of 16) and a 13-token step budget: prompts run in chunks of <= 13 tokens."""
    return LLM(num_kv_blocks=6, max_num_batched_tokens=13)


def test_chunked_prefill_gives_the_same_values(small, reference):
    ids = small.get_tokenizer().encode(PREFIX)[:50]
    steps = small.llm_engine.stats.num_steps
    out = small.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert small.llm_engine.stats.num_steps - steps == 4  # 13 + 13 + 13 + 11
    check(out.prompt_logprobs, ids, reference(ids), 2, out.prompt_logprob_ranks)
    assert_pool_clean(small.llm_engine)


def test_prefix_cache_hit_positions_are_scored_not_skipped(llm, reference):
    tok = llm.get_tokenizer()
    shared = tok.encode(PREFIX)[:64]  # 4 full blocks of 16
    first, second = shared + tok.encode(" Who wrote Hamlet?"), shared + tok.encode(" What is an atom?")
    kv = llm.llm_engine.kv_cache_manager
    llm.generate(first, SamplingParams(temperature=0, max_tokens=2))  # caches the shared blocks
    hits = kv.prefix_cache_hits
    out = llm.generate(second, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert kv.prefix_cache_hits == hits  # no hit taken: the cached positions were computed and scored
    check(out.prompt_logprobs, second, reference(second), 1, out.prompt_logprob_ranks)
    llm.generate(second, SamplingParams(temperature=0, max_tokens=2))  # without prompt logprobs: hits again
    assert kv.prefix_cache_hits >= hits + 64
    assert_pool_clean(llm.llm_engine)


def test_preemption_in_the_middle_of_the_prompt_does_not_duplicate_entries(small, reference):
    """A (40-token prompt, 3 blocks) decodes while B (64 tokens) is prefilled; B's 4th block does not fit, so B is
    preempted with 48 positions scored, and resumes after A ends (its scored blocks may hit the cache)."""
    tok = small.get_tokenizer()
    a, b = (tok.encode(PREFIX) * 2)[:40], (tok.encode(PREFIX)[::-1] * 2)[:64]
    engine = small.llm_engine
    engine.add_request(a, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rid = engine.add_request(b, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = done[rid]
    assert out.metrics.num_preemptions >= 1  # (B samples once: it can only be preempted inside its prompt)
    check(out.prompt_logprobs, b, reference(b), 2, out.prompt_logprob_ranks)
    assert_pool_clean(engine)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_prompt_logprobs_out_of_range_is_a_value_error(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)
