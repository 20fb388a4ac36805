"""The OpenAI-compatible server through the official ``openai`` client and raw HTTP (live server, real model)."""

import asyncio
import json

import httpx
import openai
import pytest

from kvserve import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.server]

CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(server, client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] and model_name.startswith("SmolLM2-135M-Instruct")
    assert client.models.retrieve(model_name).id == model_name
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_usage_and_stream_equals_non_stream(client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=0.8, seed=7)
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert full.usage.prompt_tokens == 4 and full.usage.completion_tokens <= 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # usage only on one extra final chunk with empty choices
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    plain = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain) and "".join(c.choices[0].text for c in plain) == choice.text


def test_chat_usage_and_stream_equals_non_stream(client, model_name):
    kw = dict(model=model_name, messages=CHAT, max_completion_tokens=8, temperature=0.7, seed=3)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.completion_tokens <= 8 and full.usage.prompt_tokens > 10

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_matches_offline_chat(client, model_name, llm):
    got = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids)


def test_echo_stop_logprobs_and_token_prompts(client, model_name, tokenizer):
    echo = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0)
    assert echo.choices[0].text == "Hello" + plain.choices[0].text

    ids = tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    by_text = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == by_ids.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)

    two = client.completions.create(model=model_name, prompt=["Hello", "The capital of France is"], max_tokens=4,
                                    temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[1].text == by_text.choices[0].text

    stopped = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=[by_text.choices[0].text.strip()[:3]])
    assert stopped.choices[0].finish_reason == "stop"

    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_parallel_sampling_n(client, model_name):
    kw = dict(model=model_name, prompt=["Once upon a time", "Hello"], max_tokens=6, temperature=0.9, seed=5, n=2)
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert 4 <= full.usage.completion_tokens <= 24 and full.usage.prompt_tokens == 4 + 1
    texts = {}
    finish = {}
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    lp = client.completions.create(**{**kw, "prompt": "Hello"}, logprobs=1)
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) >= 1 for c in lp.choices)

    greedy = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0, n=3)
    assert len({c.message.content for c in greedy.choices}) == 1 and [c.index for c in greedy.choices] == [0, 1, 2]
    single = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0)
    assert greedy.choices[0].message.content == single.choices[0].message.content
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_32_concurrent_greedy_requests_match_offline(server, model_name, llm):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*[c.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts])

    got = asyncio.run(run())
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [r.choices[0].text for r in got] == [o.outputs[0].text for o in want]
    assert [r.usage.completion_tokens for r in got] == [len(o.outputs[0].token_ids) for o in want]
    m = server.wait_idle()
    assert m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0


def _post(server, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, "priority"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 300}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0, "stream": True}, "n"),
])
def test_bad_input_is_400_with_openai_error(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


def test_unknown_route_404_wrong_method_405_and_still_serving(server, client, model_name):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = _post(server, path, {**body, "model": "gpt-4"})  # an unknown model: 404, as OpenAI and vLLM answer
        assert r.status_code == 404 and r.json()["error"] == {
            "message": f"The model 'gpt-4' does not exist; this server serves {model_name!r}",
            "type": "not_found_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_names(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:inter_token_latency_seconds_bucket",
                 "kvserve:e2e_request_latency_seconds_bucket", "kvserve:num_requests_running",
                 "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc", "kvserve:num_preemptions_total",
                 "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
                 'kvserve:request_success_total{finished_reason="length"'):
        assert name in text, name
    m = server.metrics()
    assert m["kvserve:time_to_first_token_seconds_count"] >= 1 and m["kvserve:generation_tokens_total"] >= 3
    assert m['kvserve:request_success_total{finished_reason="length"}'] >= 1
    # the same prompt twice: the second finds the first's full blocks in the prefix cache
    long_prompt = "The history of the printing press begins with movable type. " * 6
    for _ in range(2):
        client.completions.create(model=model_name, prompt=long_prompt, max_tokens=1, temperature=0)
    m = server.metrics()
    assert m["kvserve:prefix_cache_hits_total"] >= 48
    assert m["kvserve:prefix_cache_queries_total"] > m["kvserve:prefix_cache_hits_total"]
