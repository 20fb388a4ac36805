"""A streamed chat's first chunk (the role) goes out with the first token, not before the prompt is processed:
clients time TTFT from the first chunk (vLLM's benchmark does)."""

import json

import httpx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.server]


def test_role_chunk_arrives_after_the_first_token(server):
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 18)  # ~200 tokens of prefill
    before = server.metrics()["kvserve:time_to_first_token_seconds_count"]
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 3, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # the engine records a request's first token before it routes that output to the request's stream, so
        # by the time the first chunk exists, the first token does
        assert server.metrics()["kvserve:time_to_first_token_seconds_count"] == before + 1
        chunk = json.loads(first[len("data: "):])
        assert chunk["choices"][0]["delta"]["role"] == "assistant"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
