"""``echo`` + ``logprobs`` on ``/v1/completions`` (the prompt's logprobs, OpenAI's legacy shape) and ``echo`` with
``max_tokens: 0`` on the live server: the values are the engine's ``prompt_logprobs``, the token names and offsets
``TokenVocab``'s (byte-level tokens named by their raw bytes)."""

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.engine.detokenizer import TokenVocab

pytestmark = [pytest.mark.real_model, pytest.mark.server]

PROMPT = "My favourite food: \U0001F355 and \U0001F363. Also"  # the emoji are byte-level token pieces


def _post(server, body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={**body, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab(tokenizer)


def test_echo_logprobs_are_the_prompt_logprobs_then_the_completion(server, llm, tokenizer, vocab):
    ids = tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2}
    echoed = _post(server, {**body, "echo": True})["choices"][0]
    plain = _post(server, body)["choices"][0]
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    lp, gen = echoed["logprobs"], plain["logprobs"]
    n = len(ids)
    assert echoed["text"] == PROMPT + plain["text"]
    names = [vocab.token_name(t) for t in ids]
    assert "\\xf0\\x9f" in "".join(names)  # emoji bytes are named by their raw bytes, not U+FFFD
    assert lp["tokens"] == names + gen["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, n):
        assert lp["token_logprobs"][pos] == pytest.approx(ref[pos][ids[pos]], abs=1e-4)
        assert lp["top_logprobs"][pos] == pytest.approx({vocab.token_name(t): v for t, v in ref[pos].items()},
                                                        abs=1e-4)
    offsets, end = vocab.text_offsets(ids)
    assert end == len(PROMPT)
    assert lp["text_offset"] == offsets + [o + len(PROMPT) for o in gen["text_offset"]]
    for key in ("token_logprobs", "top_logprobs"):  # the completion part is the plain request's
        assert lp[key][n:] == gen[key]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    full = _post(server, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    c = full["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ids) and all(len(t) == 1 for t in c["logprobs"]["top_logprobs"][1:])
    assert full["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    text_only = _post(server, {"prompt": [ids], "max_tokens": 0, "echo": True})["choices"][0]
    assert text_only["text"] == PROMPT and text_only["logprobs"] is None
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ vLLM's prompt_logprobs field
CHAT = [{"role": "user", "content": "Write three food emoji: \U0001F355"}]


def _assert_vllm_prompt_logprobs(got, ids, out, k, vocab):
    """``got`` (the JSON field) is vLLM's shape over prompt ``ids`` with the offline ``RequestOutput`` ``out``'s
    values: ``null`` first, then the prompt token (first key, its rank over the whole vocabulary) and the top ``k``
    by logprob with ranks 1..k, byte-exact names."""
    ref, ref_ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        entry, t = got[pos], ids[pos]
        keys = [int(key) for key in entry]
        assert keys[0] == t
        assert {tid: v["logprob"] for tid, v in zip(keys, entry.values())} == {tid: ref[pos][tid] for tid in keys}
        assert all(v["decoded_token"] == vocab.token_name(tid) for tid, v in zip(keys, entry.values()))
        top = [tid for tid, _ in sorted(ref[pos].items(), key=lambda kv: -kv[1])[:k]]  # offline top k, best first
        ranked = {tid: v["rank"] for tid, v in zip(keys, entry.values())}
        assert set(keys) == set(top) | {t}
        assert [ranked[tid] for tid in top] == list(range(1, k + 1))
        assert ranked[t] == ref_ranks[pos] == (top.index(t) + 1 if t in top else ranked[t])
        assert t in top or ranked[t] > k  # outside the top k: its rank is still counted


def test_prompt_logprobs_field_equals_offline(server, llm, tokenizer, vocab):
    """Completions: per choice (each of n), ``prompt_logprobs: 2`` equal to ``LLM.generate(prompt_logprobs=2)``;
    with ``echo`` + ``logprobs: 1`` too, each answer keeps its own top k. Chat: at the top level."""
    ids = tokenizer.encode(PROMPT)
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    full = _post(server, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "n": 2, "echo": True,
                          "logprobs": 1})
    for c in full["choices"]:
        _assert_vllm_prompt_logprobs(c["prompt_logprobs"], ids, ref, 2, vocab)
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"][1:])  # echo: top 1 (+ the token)
    names = [list(e.values())[0]["decoded_token"] for e in full["choices"][0]["prompt_logprobs"][1:]]
    assert names == [vocab.token_name(t) for t in ids[1:]] and "\\xf0\\x9f" in "".join(names)
    assert "prompt_logprobs" not in _post(server, {"prompt": PROMPT, "max_tokens": 1})["choices"][0]

    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": CHAT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}).json()
    _assert_vllm_prompt_logprobs(r["prompt_logprobs"], out.prompt_token_ids, out, 1, vocab)
    assert "prompt_logprobs" not in r["choices"][0]


@pytest.mark.parametrize("path,body,words", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 0, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "[0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 1}, "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, ""),
])
def test_prompt_logprobs_bad_values_are_400(server, path, body, words):
    r = httpx.post(server.url + path, json={"max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and words in err["message"], err
