"""Sampling, stop conditions and incremental detokenization on the real model."""

import math

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.request import Request
from kvserve.sample.sampler import Sampler
from tests.conftest import assert_pool_clean


def chat(llm, text):
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.slow
def test_seeded_request_is_reproducible_across_batch_compositions(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234)
    target = chat(llm, "Write a sentence about rivers.")
    alone = llm.generate(target, sp)[0].outputs[0].token_ids
    others = [chat(llm, q) for q in ("Name a fruit.", "Count to five.", "What is rain?")]
    unseeded = SamplingParams(temperature=1.0, max_tokens=30)
    mixed = llm.generate(others[:1] + [target] + others[1:],
                         [unseeded, sp, SamplingParams(temperature=0, max_tokens=5), SamplingParams(seed=7)])
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate([target, others[0]], [sp, sp])
    assert again[0].outputs[0].token_ids == alone
    different_seed = llm.generate(target, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24,
                                                         seed=4321))[0]
    assert different_seed.outputs[0].token_ids != alone


def test_stop_string_spanning_two_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = chat(llm, "Tell me about the Eiffel Tower.")
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    ids, full = greedy.token_ids, greedy.text
    # pick a boundary between two word tokens, after a few tokens, and a stop string crossing it
    for i in range(5, len(ids) - 1):
        head = tok.decode(ids[: i + 1])
        left, right = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        if len(left.strip()) >= 2 and len(right.strip()) >= 2 and full.startswith(head):
            stop = left[-2:] + right[:2]
            if full.find(stop) == len(head) - 2:
                break
    else:
        pytest.fail("no suitable token boundary")
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=stop))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.find(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.find(stop) + len(stop)]
    assert_pool_clean(llm.llm_engine)


def test_streaming_deltas_concatenate_to_text_with_emoji_and_cjk(llm):
    engine = llm.llm_engine
    prompt = chat(llm, "Write the Chinese word for hello, then a smiley emoji.")
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=48, stop=["\n\n\n"]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            if out.finished:
                final = out
    text = final.outputs[0].text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(ord(c) > 0x2E80 for c in text), text  # CJK or emoji really came out
    tok = llm.get_tokenizer()
    # a character cut by max_tokens mid-way is held back, never sent as U+FFFD (decode shows it as one)
    assert text == tok.decode(final.outputs[0].token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert final.request_id == rid


@pytest.mark.parametrize("text", ["Hello 😀 世界! 🎉🇫🇷 café — ok", "日本語のテキスト🍣と絵文字👨‍👩‍👧", "plain ascii"])
def test_detokenizer_round_trips_multibyte_text(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(finished=False))
    detok.flush()
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    multibyte = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    if text != "plain ascii":
        assert multibyte  # the text really has characters split across tokens


def test_a_request_cut_inside_a_character_drops_it_from_the_text(tokenizer):
    """The last token is the first byte(s) of a multi-byte character: no U+FFFD in any delta or the final text,
    the deltas still join to it, and the token ids keep every token."""
    text = "日本語のテキスト🍣と絵文字"
    ids = tokenizer.encode(text)
    cut = next(i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for t in ids[:cut]:
        detok.add_token(t)
        pieces.append(detok.take_delta(finished=False))
    detok.flush()
    pieces.append(detok.take_delta(finished=True))
    assert detok.token_ids == ids[:cut] and "".join(pieces) == detok.text
    assert detok.text == tokenizer.decode(ids[:cut]).rstrip("\ufffd") and "\ufffd" not in detok.text


def test_max_tokens_inside_a_character_on_the_real_model(llm):
    """Greedy Japanese (12 of its first 24 tokens end inside a character) cut by ``max_tokens`` there: no text
    holds U+FFFD, and the token ids are the uncut run's."""
    prompt = chat(llm, "Translate to Japanese: I love cherry blossoms.")
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    tok = llm.get_tokenizer()
    cuts = [n for n in range(1, len(full.token_ids) + 1) if tok.decode(full.token_ids[:n]).endswith("\ufffd")]
    assert cuts, tok.decode(full.token_ids)  # the answer really has a character split across tokens
    for n in cuts:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0]
        assert out.token_ids == full.token_ids[:n] and out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids).rstrip("\ufffd") and "\ufffd" not in out.text


def test_detokenizer_decodes_through_the_rust_tokenizer_with_the_same_text(tokenizer):
    """The default tokenizer has no clean-up step, so the detokenizer calls its ``tokenizers.Tokenizer`` directly;
    every slice it decodes gives ``tokenizer.decode``'s text, special tokens kept or skipped; a tokenizer with the
    clean-up step keeps ``tokenizer.decode``."""
    import copy

    from kvserve.engine.detokenizer import rust_backend

    assert IncrementalDetokenizer(tokenizer)._backend is tokenizer.backend_tokenizer
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi 😀 世界"}], tokenize=True,
                                             add_generation_prompt=True)
    chat_ids = list(chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"])  # transformers 5: an encoding
    ids = chat_ids + tokenizer.encode(" café — ok 🇫🇷, done.")
    assert any(t in tokenizer.all_special_ids for t in ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        for a in range(len(ids)):
            for b in range(a, min(len(ids), a + 6) + 1):
                assert detok._decode(ids[a:b]) == tokenizer.decode(ids[a:b], skip_special_tokens=skip), (a, b)
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert rust_backend(cleaning) is None and IncrementalDetokenizer(cleaning)._backend is None


def test_stop_string_is_never_streamed_before_it_is_cut(tokenizer):
    text = "The answer is 42. END of the story"
    detok = IncrementalDetokenizer(tokenizer, stop=[". END"])
    streamed = ""
    for t in tokenizer.encode(text):
        matched = detok.add_token(t)
        streamed += detok.take_delta(finished=False)
        if matched:
            break
    streamed += detok.take_delta(finished=True)
    assert streamed == "The answer is 42"


def test_finish_reasons_and_eos(llm):
    # (not "What is the capital of France?": its first token is a near-tie, "The" -1.88 vs "L" -1.97 on the float32
    # path, that the default int8 activations tip to "L'Étoile, ...")
    out = llm.generate(chat(llm, "Tell me the capital of France."), SamplingParams(temperature=0, max_tokens=64))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in llm.llm_engine.eos_token_ids
    assert "<|im_end|>" not in c.text and "Paris" in c.text
    short = llm.generate(chat(llm, "Tell me the capital of France."), SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.outputs[0].finish_reason == "length" and short.outputs[0].token_ids == c.token_ids[:3]
    ignored = llm.generate(chat(llm, "Tell me the capital of France."),
                           SamplingParams(temperature=0, max_tokens=len(c.token_ids) + 5, ignore_eos=True))[0]
    assert len(ignored.outputs[0].token_ids) == len(c.token_ids) + 5
    assert ignored.outputs[0].token_ids[: len(c.token_ids)] == c.token_ids
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.ttft > 0 and m.tpot > 0


def test_stop_token_ids_and_min_tokens(llm):
    prompt = chat(llm, "What is the capital of France?")
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_tok
    # min_tokens suppresses EOS: the short answer is forced to continue
    eos_answer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    n = len(eos_answer.token_ids)
    longer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n + 10, min_tokens=n + 2))[0].outputs[0]
    assert len(longer.token_ids) >= n + 2
    assert not set(longer.token_ids[: n + 1]) & set(llm.llm_engine.eos_token_ids)


def test_logprobs(llm):
    out = llm.generate(chat(llm, "Name a color."), SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok_id, entry in zip(c.token_ids, c.logprobs):
        assert tok_id in entry and len(entry) == 3  # greedy token is the top-1
        assert max(entry, key=entry.get) == tok_id and all(v <= 0 for v in entry.values())
    assert math.isclose(c.cumulative_logprob, sum(e[t] for e, t in zip(c.logprobs, c.token_ids)))


def test_tiny_temperature_and_top_p_never_nan():
    sampler = Sampler(eos_token_ids=[2])
    logits = torch.randn(4, 1000) * 30
    reqs = [Request(str(i), [1], sp, 100) for i, sp in enumerate([
        SamplingParams(temperature=1e-5), SamplingParams(temperature=2e-5, top_p=1e-9),
        SamplingParams(temperature=1.0, top_p=1e-9), SamplingParams(temperature=0.5, min_p=1.0, top_k=1)])]
    tokens, _ = sampler(logits, [r.sampling_state for r in reqs])
    assert tokens == logits.argmax(-1).tolist()


def test_sampler_follows_distribution():
    """Sampled frequencies match softmax(logits / T) with top-k applied (chi-square style bound)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    sp = SamplingParams(temperature=0.7, top_k=3, seed=3)
    req = Request("r", [1], sp, 100)
    sampler = Sampler()
    counts = torch.zeros(5)
    n = 4000
    for _ in range(n):
        counts[sampler(logits, [req.sampling_state])[0][0]] += 1
    p = torch.softmax(logits[0, :3] / 0.7, dim=0)
    assert counts[3:].sum() == 0
    chi2 = (((counts[:3] - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 13.8  # 2 dof, p = 0.001


def test_penalties_change_greedy_choice():
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    r = Request("r", [0], SamplingParams(temperature=0, repetition_penalty=1.5), 100)
    assert sampler(logits, [r.sampling_state])[0] == [1]  # token 0 (in the prompt) is penalised: 3/1.5 < 2.9
    r2 = Request("r2", [3], SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.0), 100)
    r2.output_token_ids.append(0)  # (the sampling state views the request's own list)
    assert sampler(logits, [r2.sampling_state])[0] == [1]
    r3 = Request("r3", [3], SamplingParams(temperature=0), 100)
    r3.output_token_ids.append(0)
    assert sampler(logits, [r3.sampling_state])[0] == [0]
