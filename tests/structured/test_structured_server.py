"""Structured outputs and tool calling through the OpenAI server, with the ``openai`` client on a live server:
``response_format`` (json_object, json_schema) and vLLM's ``guided_*`` on chat and completions, ``tools`` with
``tool_choice`` required / named / auto (streamed ``delta.tool_calls`` too), multi-turn with tool messages, and 400s
naming the field."""

import json
import re

import httpx
import openai
import pytest

from kvserve import SamplingParams
from kvserve.entrypoints.openai import tool_parsers as tp
from kvserve.entrypoints.openai.serving_options import ServingOptions
from tests.entrypoints.conftest import LiveServer
from tests.structured.common import assert_valid, bfcl_tools

pytestmark = [pytest.mark.real_model, pytest.mark.server]


@pytest.fixture(scope="module")
def tool_server():
    """Room for the tool prompt (the tools' JSON goes into the system message)."""
    s = LiveServer(num_kv_blocks=256, max_num_seqs=16, max_model_len=1024,
                   server_kwargs={"options": ServingOptions(enable_auto_tool_choice=True)}).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(tool_server):
    return tool_server.llm_model_name


@pytest.fixture(scope="module")
def tools():
    return [t for t in bfcl_tools() if t["function"]["name"] in ("add", "send_message")]


ADD_TOOL = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]  # docs/structured_outputs.md's: a short prompt
ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n</tool_call>'


def _chat(q):
    return [{"role": "user", "content": q}]


def test_response_format_and_guided_fields(model, client, tool_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    r = client.chat.completions.create(model=model, messages=_chat("Weather in Paris as JSON."), temperature=0,
                                       max_tokens=40, response_format={"type": "json_schema", "json_schema": {
                                           "name": "weather", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    assert_valid(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=model, prompt='{"name": "Tom", "age": 3}\n{"name": "Ann", "age": 5}\n',
                                  temperature=0, max_tokens=40, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    for extra, check in (({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
                         ({"guided_regex": r"[A-Z][a-z]{2,8}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
                         ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
                         ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
                          lambda t: all(isinstance(x, int) for x in json.loads(t)))):
        r = client.completions.create(model=model, prompt="My favourite colour is", temperature=0, max_tokens=24,
                                      extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (extra, r.choices[0].text)


def test_tool_choice_required_streamed_equals_non_streamed_and_validates(model, client, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kw = dict(model=model, messages=_chat("Send the message hello to Bob."), tools=tools, tool_choice="required",
              temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None and full.message.tool_calls
    for call in full.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert_valid(json.loads(call.function.arguments), schemas[call.function.name])
    calls, content, finish = _stream(client, kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def _stream(client, kw, chunks=None):
    """Streamed calls ``{index: {id, name, arguments}}``, content and finish reason of choice 0 (``chunks``:
    the stream's chunks, when already read)."""
    calls, content, finish = {}, "", None
    for chunk in chunks or client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    return calls, content, finish


def test_named_tool_choice_validates_and_streams_its_arguments_as_generated(model, client, tools):
    """The stream opens the call in its first chunk (id, type, name, ``arguments: ""``), then sends argument
    pieces as tokens arrive; they add up to the non-streamed arguments."""
    schema = tools[0]["function"]["parameters"]
    assert tools[0]["function"]["name"] == "send_message"
    kw = dict(model=model, messages=_chat("Tell USR002 that lunch is ready."), tools=tools,
              tool_choice={"type": "function", "function": {"name": "send_message"}}, temperature=0, max_tokens=60)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "send_message" and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    assert_valid(json.loads(call.function.arguments), schema)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    first = chunks[0].choices[0].delta
    (opening,) = first.tool_calls
    assert first.role == "assistant" and opening.index == 0 and opening.id.startswith("call_")
    assert (opening.type, opening.function.name, opening.function.arguments) == ("function", "send_message", "")
    pieces = [d for ch in chunks[1:] for c in ch.choices for d in c.delta.tool_calls or []]
    assert len(pieces) >= 5 and all(d.index == 0 and d.id is None and d.function.name is None for d in pieces)
    assert "".join(d.function.arguments for d in pieces) == call.function.arguments
    assert _stream(client, kw, chunks)[1:] == ("", "tool_calls")


def test_auto_parses_the_models_tool_call_format(model, client, tools):
    """"auto": the model's own ``<tool_call>`` text (here forced by a regex, as a model trained for it would
    write it) is parsed into ``tool_calls``, streamed as ``delta.tool_calls``; text without a call is content."""
    calls, content, finish = _stream(client, dict(model=model, messages=_chat("Add 3 and 4."), tools=tools,
                                                  temperature=0, max_tokens=40, extra_body={"guided_regex": ADD_CALL}))
    assert finish == "tool_calls" and content == ""
    (call,) = calls.values()
    assert call["name"] == "add" and call["id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"a", "b"}
    r = client.chat.completions.create(model=model, messages=_chat("Say hi."), tools=tools, temperature=0,
                                       max_tokens=8, extra_body={"guided_regex": "Hi there[.!]"})
    assert r.choices[0].message.content in ("Hi there.", "Hi there!") and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_required_list_cut_by_max_tokens_returns_its_complete_calls(model, client):
    """"required" with parallel calls allowed (OpenAI's default): this greedy model extends its list of calls until
    ``max_tokens``; the complete calls come back, the cut one is dropped, ``finish_reason`` "length", streamed
    and not."""
    kw = dict(model=model, messages=_chat("Add 3 and 4."), tools=ADD_TOOL, tool_choice="required", temperature=0,
              max_tokens=30)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "length" and full.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in full.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})]
    calls, content, finish = _stream(client, kw)
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]


def test_auto_content_before_a_call_is_the_same_streamed_and_not(model, client):
    """One rule (``ToolParser.content_before_call``): the text before a call loses its trailing whitespace."""
    kw = dict(model=model, messages=_chat("Add 3 and 4."), tools=ADD_TOOL, temperature=0, max_tokens=48,
              extra_body={"guided_regex": r"Sure[.!]\n\n" + ADD_CALL})
    full = client.chat.completions.create(**kw).choices[0]
    assert full.message.content in ("Sure.", "Sure!") and full.finish_reason == "tool_calls"
    calls, content, finish = _stream(client, kw)
    assert (content, finish) == (full.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]


ADD_ARGS = '{"name": "add", "arguments": {"a": 3, "b": 4}}'


@pytest.mark.parametrize("text", [
    "Sure.\n\n<tool_call>\n" + ADD_ARGS + "\n</tool_call>", "  Hi there.\n  ", "Hi <tool", "a\n<tool_call>{bad",
    "\n<tool_call>" + ADD_ARGS + "</tool_call>\n<tool_call>" + ADD_ARGS, "No call here.\n\nBye"])
def test_auto_streamer_adds_up_to_extract_fed_one_character_at_a_time(text):
    parser = tp.get_tool_parser("hermes")
    streamer = tp.AutoToolStreamer(parser)
    pieces = [p for k, ch in enumerate(text) for p in streamer.feed(ch, final=k == len(text) - 1)]
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict = {}
    for p in pieces:
        if not isinstance(p, str):
            calls.setdefault(p.index, [p.name, ""])[1] += p.arguments
    ex = parser.extract(text)
    assert content == (ex.content or "")
    assert list(calls.values()) == [[c.name, c.arguments] for c in ex.tool_calls]


REQUIRED = '[{"name": "add", "arguments": {"a": 3, "b": [4, "]}"]}}, {"name": "f", "arguments": {}}, {"name": "g"'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_streamer_adds_up_to_forced_calls_at_every_cut(choice):
    """For every prefix of the text (a cut by max_tokens anywhere): the streamed deltas add up to the
    non-streamed calls; "required" returns complete elements only, each with valid JSON arguments."""
    for end in range(len(REQUIRED) + 1):
        streamer = tp.ForcedToolStreamer(choice)
        deltas = streamer.head() + [d for ch in REQUIRED[:end] for d in streamer.feed(ch)]
        got: dict = {}
        for d in deltas:  # a call's first delta, and only it, has its id and name
            assert (d.id is not None and d.name is not None) == (d.index not in got)
            got.setdefault(d.index, [d.name, ""])[1] += d.arguments
        want = tp.forced_calls(REQUIRED[:end], choice)
        assert [tuple(v) for _, v in sorted(got.items())] == [(c.name, c.arguments) for c in want]
        if choice == "required":  # each element of REQUIRED ends with the text's only "}}"s
            assert len(want) == REQUIRED[:end].count("}}")
            assert all(isinstance(json.loads(c.arguments), dict) for c in want)


def test_tool_choice_none_leaves_tools_out_of_the_prompt(model, client, tools):
    with_tools = client.chat.completions.create(model=model, messages=_chat("Hi"), tools=tools, tool_choice="auto",
                                                max_tokens=1).usage.prompt_tokens
    none = client.chat.completions.create(model=model, messages=_chat("Hi"), tools=tools, tool_choice="none",
                                          max_tokens=1).usage.prompt_tokens
    assert none < with_tools


def test_multi_turn_with_tool_messages(model, client, tools, tool_server):
    messages = [{"role": "user", "content": "Add 3 and 4."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add",
                                                                      "arguments": '{"a": 3, "b": 4}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 7}'}]
    r = httpx.post(tool_server.url + "/tokenize", json={"messages": messages}, timeout=30)
    text = "".join(httpx.post(tool_server.url + "/detokenize", json={"tokens": r.json()["tokens"]},
                              timeout=30).json()["prompt"])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>' in text
    assert '<tool_response>\n{"result": 7}\n</tool_response>' in text
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"not": {}}}}}, "guided_json", "'not'"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"guided_regex": "(ab"}, "guided_regex", "cannot be compiled"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": "T", "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": "T", "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
      "tool_choice": "required"}, "tools", "'if'"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
])
def test_bad_structured_and_tool_inputs_are_400(tool_server, tools, body, param, words):
    body = {"messages": _chat("hi"), "max_tokens": 2, **body}
    if body.get("tools") == "T":
        body["tools"] = tools
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_offline_chat_with_tools_renders_as_the_server(llm, client, model, tool_server):
    """``LLM.chat(..., tools=...)``: the server's prompt (the same prompt tokens, the same greedy text)."""
    messages = _chat("Add 3 and 4.")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), tools=ADD_TOOL)[0]
    assert '{"type": "function", "function": {"name": "add", ' in llm.apply_chat_template(messages, tools=ADD_TOOL)
    r = client.chat.completions.create(model=model, messages=messages, tools=ADD_TOOL, temperature=0, max_tokens=6)
    assert r.usage.prompt_tokens == len(out.prompt_token_ids)
    tokenized = httpx.post(tool_server.url + "/tokenize", json={"messages": messages, "tools": ADD_TOOL}, timeout=30)
    assert tokenized.json()["tokens"] == out.prompt_token_ids
    assert r.choices[0].message.content == out.outputs[0].text
    assert len(llm.chat(messages, SamplingParams(max_tokens=1), tools=[])[0].prompt_token_ids) < r.usage.prompt_tokens


@pytest.mark.parametrize("bad,param", [
    ("add", "tools"),
    ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
    ([{"type": "code", "function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], "tools[0].function.extra"),
])
def test_offline_chat_bad_tools_are_value_errors_naming_the_field(llm, bad, param):
    with pytest.raises(ValueError, match=re.escape(param)):
        llm.chat(_chat("hi"), SamplingParams(max_tokens=1), tools=bad)
