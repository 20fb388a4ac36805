"""Streamed and non-streamed answers to the same seeded request are identical in every field a client can compare
(text, logprobs with their offsets, finish reasons, usage), over a matrix of options — stop strings (which make
the stream hold text back), logprobs, n, echo, include_stop_str_in_output, several prompts — on completions and
chat. (Speculative decoding on/off is a further axis for the engine's own tests.)"""

import itertools
import json

import httpx
import pytest

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
        if (echo and logprobs is not None) or (include and stop is None):
            continue  # echo + logprobs needs prompt logprobs (refused); include_stop_str needs a stop string
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
