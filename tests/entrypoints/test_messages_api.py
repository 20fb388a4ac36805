"""``/v1/messages`` (Anthropic's Messages API) through the official ``anthropic`` client against a live server:
plain, streamed (Anthropic's events; the final message equal to the non-streamed one), a tool round trip,
``stop_sequences``, thinking through a reasoning parser, ``count_tokens``, errors in Anthropic's shape and the API
key as ``x-api-key``."""

import json

import anthropic
import httpx
import openai
import pytest

from kvserve.entrypoints.openai.serving_options import ServingOptions
from tests.entrypoints.auto_tools import model_name, server  # noqa: F401 (fixtures: the server with auto tools)
from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]

TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused")


def _chat(server, model_name, messages, max_tokens, **kw):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    return c.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def _strip_ids(obj):
    """A message without its id (and the SDK stream helper's own ``parsed_output``)."""
    if isinstance(obj, dict):
        return {k: _strip_ids(v) for k, v in obj.items() if k not in ("id", "parsed_output")}
    if isinstance(obj, list):
        return [_strip_ids(v) for v in obj]
    return obj


def test_plain_equals_chat_completions(server, client, model_name):
    m = client.messages.create(model=model_name, max_tokens=12, messages=ASK, temperature=0,
                               system="You are brief.")
    chat = _chat(server, model_name, [{"role": "system", "content": "You are brief."}] + ASK, 12)
    assert m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")


def test_streamed_equals_non_streamed(client, model_name):
    kw = dict(model=model_name, max_tokens=20, messages=[{"role": "user", "content": "Describe the sea."}],
              temperature=0)
    plain = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert _strip_ids(final.model_dump()) == _strip_ids(plain.model_dump())


def test_stop_sequences(client, model_name):
    plain = client.messages.create(model=model_name, max_tokens=20, messages=ASK, temperature=0)
    word = plain.content[0].text.split()[2]
    m = client.messages.create(model=model_name, max_tokens=20, messages=ASK, temperature=0, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == plain.content[0].text[:plain.content[0].text.index(word)]


def test_tool_round_trip(client, model_name):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=model_name, max_tokens=40, messages=ask, tools=TOOLS, temperature=0,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and set(uses[0].input) == {"city"}
    assert first.stop_reason == "tool_use"
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": "22 C and sunny"}]}]
    second = client.messages.create(model=model_name, max_tokens=20, messages=follow, tools=TOOLS, temperature=0,
                                    tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.content[0].text
    streamed = list(client.messages.create(model=model_name, max_tokens=40, messages=ask, tools=TOOLS,
                                           temperature=0, tool_choice={"type": "tool", "name": "get_weather"},
                                           stream=True))
    args = "".join(e.delta.partial_json for e in streamed
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(args) == uses[0].input


def test_count_tokens(client, model_name):
    m = client.messages.create(model=model_name, max_tokens=4, messages=ASK, tools=TOOLS, temperature=0)
    n = client.messages.count_tokens(model=model_name, messages=ASK, tools=TOOLS)
    assert n.input_tokens == m.usage.input_tokens


@pytest.mark.parametrize("body, where", [
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "web_search_20250305"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2}}, "--reasoning-parser"),
    ({"max_tokens": 4, "messages": ASK, "bogus": 1}, "bogus"),
    ({"max_tokens": 4, "messages": "hi"}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
     "unrecognized request argument: messages[0].content[0].foo"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi", "foo": 1}]},
     "unrecognized request argument: messages[0].foo"),
    ({"max_tokens": 4, "messages": ASK, "system": [{"type": "text", "text": "x", "foo": 1}]},
     "unrecognized request argument: system[0].foo"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{**TOOLS[0], "foo": 1}]},
     "unrecognized request argument: tools[0].foo"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature must be in [0, 1]"),
    ({"max_tokens": 4, "messages": ASK, "temperature": -0.1}, "temperature must be in [0, 1]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 400}]}, "messages: the prompt has"),
])
def test_errors_in_anthropic_shape(server, model_name, body, where):
    r = httpx.post(server.url + "/v1/messages", json={"model": model_name, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert where in err["error"]["message"]


def test_unknown_model_is_404_in_anthropic_shape(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"


@pytest.fixture(scope="module")
def thinking_server():
    s = LiveServer(server_kwargs={"options": ServingOptions(reasoning_parser="deepseek_r1"), "api_key": "sekret"},
                   num_kv_blocks=128, max_num_seqs=8, max_model_len=256).start()
    yield s
    s.stop()


def test_thinking_through_the_reasoning_parser(thinking_server):
    """deepseek_r1 reads the output as reasoning until ``</think>``; ``thinking.budget_tokens`` is the sampler's
    thinking budget: after 8 reasoning tokens ``</think>`` is forced and the answer follows. The thinking block
    and the text are exactly the chat completion's ``reasoning_content`` and ``content`` under the same budget."""
    s = thinking_server
    client = anthropic.Anthropic(base_url=s.url, api_key="sekret")  # sent as x-api-key
    kw = dict(model=s.llm_model_name, max_tokens=24, messages=ASK, temperature=0,
              thinking={"type": "enabled", "budget_tokens": 8})
    m = client.messages.create(**kw)
    chat = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret").chat.completions.create(
        model=s.llm_model_name, messages=ASK, max_tokens=24, temperature=0,
        extra_body={"thinking_token_budget": 8, "chat_template_kwargs": {"enable_thinking": True}})
    free = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})  # deepseek_r1 thinks anyway
    assert [b.type for b in free.content] == ["thinking"]
    assert m.content[0].type == "thinking" and m.content[0].thinking == chat.choices[0].message.reasoning_content
    assert "".join(b.text for b in m.content if b.type == "text") == (chat.choices[0].message.content or "")
    tok = s.server.config.app.state.engine_client.tokenizer
    cut = m.content[0].thinking
    assert len(tok.encode(cut, add_special_tokens=False)) <= 8  # SmolLM2 alone would think on:
    assert free.content[0].thinking.startswith(cut) and len(free.content[0].thinking) > len(cut)
    with client.messages.stream(**kw) as st:
        final = st.get_final_message()
    assert _strip_ids(final.model_dump()) == _strip_ids(m.model_dump())
    bad = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "wrong"}, json={**kw, "thinking": None})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
