"""Streamed and non-streamed answers to the same seeded request are identical in every field a client can compare
(text, logprobs with their offsets, finish reasons, usage), over a matrix of options — stop strings (which make
the stream hold text back), logprobs, n, echo (with logprobs: prompt logprobs; with max_tokens 0: the prompt
alone), include_stop_str_in_output, several prompts — on completions and chat; and speculative decoding on/off: a
server with n-gram speculation gives the same greedy answers, field by field, as one without."""

import itertools
import json

import httpx
import pytest

from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]

PROMPTS = ["The capital of France is", "Once upon a time"]
STOP = [".\n", " answer"]  # multi-character: the stream holds back up to 6 characters
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _complete(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path, body) -> list:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1
    return events


def _finish_of(reasons: list):
    """The choice's finish reason: non-null exactly once, on its last chunk."""
    assert all(r is None for r in reasons[:-1]) and reasons[-1] is not None, reasons
    return reasons[-1]


def _completion_from_stream(events: list) -> tuple:
    choices: dict = {}
    for e in events[:-1]:
        for c in e["choices"]:
            acc = choices.setdefault(c["index"], {"text": "", "lp": None, "reasons": []})
            acc["text"] += c["text"]
            acc["reasons"].append(c["finish_reason"])
            if c["logprobs"] is not None:
                lp = acc["lp"] = acc["lp"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                               "text_offset": []}
                for k in lp:
                    lp[k] += c["logprobs"][k]
    out = [{"index": i, "text": a["text"], "logprobs": a["lp"], "finish_reason": _finish_of(a["reasons"])}
           for i, a in sorted(choices.items())]
    assert events[-1]["choices"] == []
    return out, events[-1]["usage"]


def _chat_from_stream(events: list) -> tuple:
    choices: dict = {}
    for e in events[:-1]:
        for c in e["choices"]:
            acc = choices.setdefault(c["index"], {"content": "", "roles": [], "lp": None, "reasons": []})
            acc["content"] += c["delta"].get("content") or ""
            acc["roles"].append(c["delta"].get("role"))
            acc["reasons"].append(c["finish_reason"])
            if c["logprobs"] is not None:
                acc["lp"] = acc["lp"] or {"content": [], "refusal": None}
                acc["lp"]["content"] += c["logprobs"]["content"]
    out = []
    for i, a in sorted(choices.items()):
        assert a["roles"][0] == "assistant" and set(a["roles"][1:]) <= {None}
        out.append({"index": i, "message": {"role": "assistant", "content": a["content"], "refusal": None},
                    "logprobs": a["lp"], "finish_reason": _finish_of(a["reasons"])})
    assert events[-1]["choices"] == []
    return out, events[-1]["usage"]


def _matrix():
    for stop, logprobs, n, echo, include in itertools.product([None, STOP], [None, 2], [1, 2], [False, True],
                                                              [False, True]):
        if include and stop is None:
            continue  # include_stop_str needs a stop string
        if echo and logprobs is not None and (stop is None or n != (1 if include else 2)):
            continue  # (echo + logprobs: two cases, with stop strings, to keep the matrix small)
        yield stop, logprobs, n, echo, include


@pytest.mark.parametrize("stop,logprobs,n,echo,include", list(_matrix()))
def test_completions_stream_equals_non_stream(server, stop, logprobs, n, echo, include):
    body = {"prompt": PROMPTS if n == 1 and not echo else PROMPTS[0], "max_tokens": 12, "temperature": 0.6,
            "seed": 11, "n": n, "echo": echo, "logprobs": logprobs, "stop": stop,
            "include_stop_str_in_output": include}
    full = _complete(server, "/v1/completions", body)
    choices, usage = _completion_from_stream(_stream(server, "/v1/completions", body))
    assert choices == full["choices"]
    assert usage == full["usage"]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_echo_with_max_tokens_0_stream_equals_non_stream(server, logprobs):
    """The prompt alone (vLLM's prompt scoring): its text, its logprobs, no completion tokens, "length"."""
    body = {"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": logprobs, "n": 2, "temperature": 0.6,
            "seed": 3}
    full = _complete(server, "/v1/completions", body)
    choices, usage = _completion_from_stream(_stream(server, "/v1/completions", body))
    assert choices == full["choices"] and usage == full["usage"]
    assert [c["text"] for c in choices] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert {c["finish_reason"] for c in choices} == {"length"} and usage["completion_tokens"] == 0
    if logprobs is not None:
        assert [c["logprobs"]["tokens"][0] for c in choices] == ["The"] * 2 + ["Once"] * 2
        assert all(c["logprobs"]["token_logprobs"][0] is None and None not in c["logprobs"]["token_logprobs"][1:]
                   for c in choices)


@pytest.mark.parametrize("stop,logprobs,n,include", [
    (stop, lp, n, inc) for stop, lp, n, inc in itertools.product([None, STOP], [False, True], [1, 2], [False, True])
    if stop is not None or not inc])
def test_chat_stream_equals_non_stream(server, stop, logprobs, n, include):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0.6, "seed": 11, "n": n, "stop": stop,
            "include_stop_str_in_output": include, "logprobs": logprobs, **({"top_logprobs": 2} if logprobs else {})}
    full = _complete(server, "/v1/chat/completions", body)
    choices, usage = _chat_from_stream(_stream(server, "/v1/chat/completions", body))
    assert choices == full["choices"]
    assert usage == full["usage"]


def test_the_matrix_exercises_stop_strings(server):
    """The stop strings do fire in this matrix (so the held-back text path is covered), with and without
    include_stop_str_in_output."""
    for include in (False, True):
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": STOP,
                "include_stop_str_in_output": include}
        c = _complete(server, "/v1/completions", body)["choices"][0]
        assert c["finish_reason"] == "stop" and c["text"] == (" Paris.\n" if include else " Paris")


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"
SPEC_CASES = [  # greedy; every option of the matrix above appears at least once
    ("/v1/completions", {"prompt": COUNTING, "max_tokens": 20, "stop": [" 7,"], "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": [COUNTING, PROMPTS[0]], "max_tokens": 8, "stop": STOP, "n": 2, "echo": True}),
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "logprobs": 2, "echo": True, "stop": ["."]}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "stop": STOP, "include_stop_str_in_output": True}),
]


@pytest.fixture(scope="module")
def spec_server():
    """A server like ``server`` but with n-gram speculation (k = 4)."""
    s = LiveServer(num_kv_blocks=128, max_num_seqs=8, max_model_len=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4}).start()
    yield s
    s.stop()


def test_speculation_on_and_off_give_the_same_answers_streamed_and_not(server, spec_server):
    for path, body in SPEC_CASES:
        body = {**body, "temperature": 0}
        plain, spec = _complete(server, path, body), _complete(spec_server, path, body)
        assert spec["choices"] == plain["choices"], (path, body)
        assert spec["usage"] == plain["usage"], (path, body)
        from_stream = _chat_from_stream if "chat" in path else _completion_from_stream
        choices, usage = from_stream(_stream(spec_server, path, body))
        assert choices == spec["choices"] and usage == spec["usage"], (path, body)
    assert spec_server.metrics()["kvserve:spec_decode_num_accepted_tokens_total"] > 0  # drafts were verified
