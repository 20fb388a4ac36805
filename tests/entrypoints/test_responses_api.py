"""``/v1/responses`` through the official ``openai`` client against a live server: plain, streamed (typed events,
the final response equal to the non-streamed one), a function-tool round trip with ``function_call_output``, a
JSON schema, ``previous_response_id``, retrieve / delete / cancel, and the refusals."""

import json

import httpx
import openai
import pytest

from tests.entrypoints.auto_tools import model_name, server  # noqa: F401 (fixtures: the server with auto tools)
pytestmark = [pytest.mark.real_model, pytest.mark.server]

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _chat(client, model_name, messages, max_tokens):
    return client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens,
                                          temperature=0)


def _strip_ids(obj):
    """A response's JSON without its generated ids and timestamps (they differ between two requests)."""
    if isinstance(obj, dict):
        return {k: _strip_ids(v) for k, v in obj.items() if k not in ("id", "created_at", "call_id", "item_id")}
    if isinstance(obj, list):
        return [_strip_ids(v) for v in obj]
    return obj


def test_plain_equals_chat_completions(client, model_name):
    r = client.responses.create(model=model_name, input="Name a fruit.", max_output_tokens=12, temperature=0)
    chat = _chat(client, model_name, [{"role": "user", "content": "Name a fruit."}], 12)
    assert r.status == "completed" and r.object == "response"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert [o.type for o in r.output] == ["message"]


def test_instructions_are_a_system_message(client, model_name):
    r = client.responses.create(model=model_name, instructions="Answer in French.", input="Name a fruit.",
                                max_output_tokens=10, temperature=0)
    chat = _chat(client, model_name, [{"role": "system", "content": "Answer in French."},
                                      {"role": "user", "content": "Name a fruit."}], 10)
    assert r.output_text == chat.choices[0].message.content


def test_streamed_equals_non_streamed(client, model_name):
    kw = dict(model=model_name, input="Write one sentence about the sea.", max_output_tokens=20, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text
    final = events[-1].response
    assert _strip_ids(final.model_dump()) == _strip_ids(plain.model_dump())


def test_max_output_tokens_is_incomplete(client, model_name):
    r = client.responses.create(model=model_name, input="Count from one to fifty.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_function_tool_round_trip(client, model_name):
    first = client.responses.create(model=model_name, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=40, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
              "arguments": calls[0].arguments},
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"}]
    second = client.responses.create(model=model_name, input=items, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=20, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output_text
    # the same conversation continued from the stored first response: the same prompt, the same answer
    cont = client.responses.create(model=model_name, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                   input=[items[2]], max_output_tokens=20, temperature=0)
    assert cont.usage.input_tokens == second.usage.input_tokens
    assert cont.output_text == second.output_text
    assert cont.previous_response_id == first.id


def test_streamed_function_call(client, model_name):
    kw = dict(model=model_name, input="Weather in Rome?", tools=TOOLS,
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args == plain.output[0].arguments
    assert _strip_ids(events[-1].response.model_dump()) == _strip_ids(plain.model_dump())


def test_json_schema(client, model_name):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=model_name, input="Invent a person.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_retrieve_delete_and_unknown_ids(client, model_name):
    r = client.responses.create(model=model_name, input="Hi", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model_name, input="Hi", previous_response_id="resp_unknown")
    unstored = client.responses.create(model=model_name, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_codex_include_encrypted_reasoning_is_accepted(client, model_name):
    """Codex sends ``include: ["reasoning.encrypted_content"]`` with ``store: false``: accepted (as vLLM does), the
    answer is the plain one and carries no encrypted content."""
    kw = dict(model=model_name, input="Hi", max_output_tokens=6, temperature=0, store=False)
    r = client.responses.create(**kw, include=["reasoning.encrypted_content"])
    assert r.status == "incomplete" and r.output_text == client.responses.create(**kw).output_text  # 6 tokens
    assert all(getattr(item, "encrypted_content", None) is None for item in r.output)


def test_cancel_in_flight(server, client, model_name):
    stream = client.responses.create(model=model_name, input="Tell a long story.", max_output_tokens=200,
                                     temperature=0, stream=True)
    rid = None
    for e in stream:
        if e.type == "response.created":
            rid = e.response.id
        if e.type == "response.output_text.delta":
            break
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled"
    rest = [e.type for e in stream]
    assert rest[-1] == "response.failed"  # no completion: the stream ends with the cancelled response
    assert server.wait_idle()["kvserve:kv_cache_usage_perc"] == 0
    assert client.responses.retrieve(rid).status == "cancelled"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}},
     "text.format"),
    ({"input": "x", "unknown_field": 1}, "unknown_field"),
    ({"input": [{"role": "user", "content": "hi", "foo": 1}]}, "input[0].foo"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi", "foo": 1}]}]},
     "input[0].content[0].foo"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "foo": 1}]}, "input[0].foo"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "foo": 1}]}, "tools[0].foo"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_input_items_list_through_the_client(server, client, model_name):
    """``client.responses.input_items.list``: a stored response's input as items, OpenAI's list (newest first by
    default; ``limit``, ``order``, ``after`` paging; the client's auto-paging walks every page); 400s naming a bad
    query parameter; 404 for an unknown id or an unstored response."""
    given = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]}]
    r = client.responses.create(model=model_name, input=given, max_output_tokens=2, temperature=0)
    page = client.responses.input_items.list(r.id)
    assert page.object == "list" and page.has_more is False
    texts = [item.content[0].text for item in page.data]
    assert texts == ["Bye", "Hello", "Hi", "Be brief."]  # desc: newest first
    assert [i.role for i in page.data] == ["user", "assistant", "user", "system"]
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    assert page.data[1].content[0].type == "output_text" and page.data[2].content[0].type == "input_text"
    first = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["Be brief.", "Hi"] and first.has_more is True
    rest = client.responses.input_items.list(r.id, limit=2, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["Hello", "Bye"] and rest.has_more is False
    walked = [i.content[0].text for i in client.responses.input_items.list(r.id, limit=1, order="asc")]
    assert walked == ["Be brief.", "Hi", "Hello", "Bye"]
    text = client.responses.create(model=model_name, input="Hi", max_output_tokens=2, temperature=0)
    (item,) = client.responses.input_items.list(text.id).data
    assert (item.type, item.role, item.content[0].type, item.content[0].text) == ("message", "user", "input_text",
                                                                                  "Hi")
    for query, param in [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"), ({"include": "x"}, "include")]:
        got = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params=query, timeout=30)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    unstored = client.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)
