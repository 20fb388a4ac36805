"""``echo`` + ``logprobs`` on ``/v1/completions`` (the prompt's logprobs, OpenAI's legacy shape) and ``echo`` with
``max_tokens: 0`` on the live server: the values are the engine's ``prompt_logprobs``, the token names and offsets
``TokenVocab``'s (byte-level tokens named by their raw bytes)."""

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.engine.detokenizer import TokenVocab

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
