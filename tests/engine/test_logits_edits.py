"""``logit_bias``, ``allowed_token_ids``, ``bad_words`` and the thinking budget in the sampler: exact ids on the
real model, the same bits alone and beside other requests, and the budget's state machine without a model."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sample.logits_edits import banned_tokens
from kvserve.sample.sampler import Sampler
from kvserve.sample.state import SamplingState
from kvserve.sample.thinking import ThinkingBudget
from tests.conftest import assert_pool_clean

OTHERS = ["Write a haiku about the sea.", "List three prime numbers: 2, 3,", "Name a fruit.", "Count: one two"]


def chat(llm, text):
    return llm.apply_chat_template([{"role": "user", "content": text}])


def _answer(out):
    c = out.outputs[0]
    return c.token_ids, [sorted(d.items()) for d in c.logprobs]


def _alone_and_in_batch(llm, prompt, sp):
    """The answer alone, and the same request in the middle of four others (greedy, sampled, seeded)."""
    alone = _answer(llm.generate(prompt, sp)[0])
    others = [chat(llm, q) for q in OTHERS]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=1.0, max_tokens=30),
                          sp, SamplingParams(seed=3, max_tokens=20), SamplingParams(temperature=0, max_tokens=4)])
    assert _answer(mixed[2]) == alone
    assert_pool_clean(llm.llm_engine)
    return alone


def test_logit_bias_forces_and_bans_tokens_batch_invariantly(llm):
    tok = llm.get_tokenizer()
    prompt = chat(llm, "What is the capital of France?")
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    target = tok.encode(" Banana", add_special_tokens=False)[0]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, logit_bias={target: 100.0, plain[0]: -100.0})
    ids, _ = _alone_and_in_batch(llm, prompt, sp)
    assert ids[0] == target and plain[0] not in ids
    # a small bias moves nothing here: the greedy answer is kept
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={target: 0.5}))[0] \
        .outputs[0].token_ids == plain


def test_allowed_token_ids_only_those_are_sampled(llm):
    tok = llm.get_tokenizer()
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe", ".")]
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=0, allowed_token_ids=allowed,
                        ignore_eos=True)
    ids, _ = _alone_and_in_batch(llm, chat(llm, "Is the sky blue?"), sp)
    assert len(ids) == 12 and set(ids) <= set(allowed)


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    prompt = chat(llm, "Tell me the capital of France.")
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert "Paris" in plain.text
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1, bad_words=["Paris"])
    ids, _ = _alone_and_in_batch(llm, prompt, sp)
    text = tok.decode(ids)
    assert "Paris" not in text and ids != plain.token_ids


def test_thinking_budget_forces_the_end_marker_at_position_n(llm):
    """The prompt opens the reasoning (``<think>`` at the end of the generation prompt, as Qwen3's template
    writes it); SmolLM2 has no think token, so ``</think>`` is its text's token ids, forced one by one."""
    tok = llm.get_tokenizer()
    prompt = chat(llm, "Think about why the sky is blue, then answer.") + "<think>\n"
    end_ids = tok.encode("</think>", add_special_tokens=False)
    assert len(end_ids) > 1
    for n in (0, 3, 10):
        sp = SamplingParams(temperature=0, max_tokens=n + len(end_ids) + 6, logprobs=1, thinking_token_budget=n,
                            ignore_eos=True)
        ids, _ = _alone_and_in_batch(llm, prompt, sp)
        assert ids[n:n + len(end_ids)] == end_ids  # forced exactly at position n
        assert all(ids[i:i + len(end_ids)] != end_ids for i in range(n))  # no earlier end: n reasoning tokens
        assert len(ids) == n + len(end_ids) + 6  # and the answer follows
    # without the budget the model does not close it there
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10 + len(end_ids), ignore_eos=True))[0]
    assert free.outputs[0].token_ids[10:10 + len(end_ids)] != end_ids


def test_thinking_budget_waits_for_the_model_to_open_its_reasoning(llm):
    prompt = chat(llm, "Say hello.")  # no <think> in the prompt: nothing is forced until the model writes one
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    budgeted = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=0))[0]
    assert budgeted.outputs[0].token_ids == plain


@pytest.mark.parametrize("kw,field", [
    ({"logit_bias": {10**7: 1.0}}, "logit_bias"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids")])
def test_token_ids_outside_the_vocabulary_are_refused(llm, kw, field):
    with pytest.raises(ValueError, match=field):
        llm.llm_engine.add_request("Hi", SamplingParams(**kw))
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("kw,msg", [
    ({"logit_bias": {1: 100.5}}, r"logit_bias\[1\] must be in \[-100.0, 100.0\]"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"reasoning_markers": ("<think>",)}, "reasoning_markers")])
def test_bad_values_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.real_model
def test_edits_refused_with_speculative_decoding():
    spec = LLM(num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="logit_bias is not supported with speculative decoding"):
        spec.llm_engine.add_request("Hi", SamplingParams(logit_bias={1: 1.0}))


# ---------------------------------------------------------------------------------------------------- model-free
def test_budget_state_machine_counts_and_forces_in_sequence():
    tb = ThinkingBudget(3, start_ids=[7], end_ids=[8, 9], open_at_start=False)
    out: list = []
    for t, forced in [(1, None), (7, None), (2, None), (3, None), (4, 8), (8, 9), (9, None), (5, None)]:
        out.append(t)
        tb.sync(out)
        assert tb.forced_token() == forced, (out, tb.phase)
    tb.sync(out[:3])  # a rollback starts over
    assert (tb.phase, tb.count) == ("thinking", 1)
    natural = ThinkingBudget(5, [7], [8, 9], open_at_start=True)
    natural.sync([1, 8, 9, 2, 2, 2, 2, 2])
    assert natural.phase == "done" and natural.forced_token() is None


def test_banned_tokens():
    assert banned_tokens([[5], [1, 2, 3]], [9, 1, 2]) == [5, 3]
    assert banned_tokens([[1, 2, 3]], [2, 1]) == []


def test_sampler_rows_are_edited_alone_as_in_a_batch():
    """The same row gives the same token whatever rows surround it (every edit reads its own row only)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    tb = ThinkingBudget(0, [1], [42], open_at_start=True)
    states = [SamplingState("a", SamplingParams(temperature=0, logit_bias={3: 100.0}), [0], []),
              SamplingState("b", SamplingParams(temperature=0), [0], []),
              SamplingState("c", SamplingParams(temperature=0, thinking_token_budget=0), [0], [], thinking=tb),
              SamplingState("d", SamplingParams(temperature=0, allowed_token_ids=[5, 6]), [0], [])]
    batch, _ = Sampler()(logits, states)
    assert batch[0] == 3 and batch[2] == 42 and batch[3] in (5, 6)
    for i in range(4):
        if states[i].thinking is not None:
            states[i].thinking = ThinkingBudget(0, [1], [42], open_at_start=True)
        assert Sampler()(logits[i:i + 1], [states[i]])[0] == [batch[i]]


def test_a_ban_that_would_leave_no_token_is_lifted():
    st = SamplingState("a", SamplingParams(temperature=0, allowed_token_ids=[4], bad_words=["x"]), [0], [])
    st.bad_words_token_ids = [[4]]
    assert Sampler()(torch.randn(1, 10), [st])[0] == [4]
