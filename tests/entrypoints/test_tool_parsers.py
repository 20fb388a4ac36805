"""Tool-call parsers of every family: several calls, text around them, a cut call, malformed calls (content, never
an error), and the "auto" stream equal to the non-streamed answer at every cut point."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai import tool_parsers as tp

W = '{"city": "Paris"}'


def calls_of(parser_name: str, text: str):
    ex = tp.get_tool_parser(parser_name).extract(text)
    return ex.content, [(c.name, json.loads(c.arguments)) for c in ex.tool_calls]


CASES = [
    # hermes
    ("hermes", '<tool_call>{"name": "w", "arguments": ' + W + '}</tool_call>', (None, [("w", {"city": "Paris"})])),
    ("hermes", 'Sure.\n<tool_call>{"name": "w", "arguments": {}}</tool_call>\n<tool_call>{"name": "v", '
               '"arguments": {"a": 1}}</tool_call>', ("Sure.", [("w", {}), ("v", {"a": 1})])),
    ("hermes", "<tool_call>{bad json</tool_call>", ("<tool_call>{bad json</tool_call>", [])),
    # llama3_json
    ("llama3_json", '{"name": "w", "parameters": ' + W + '}', (None, [("w", {"city": "Paris"})])),
    ("llama3_json", '<|python_tag|>{"name": "w", "parameters": {}}; {"name": "v", "arguments": {"x": [1]}}',
     (None, [("w", {}), ("v", {"x": [1]})])),
    ("llama3_json", 'Let me check.\n<|python_tag|>{"name": "w", "parameters": {}}', ("Let me check.", [("w", {})])),
    ("llama3_json", ' {"name": "w", "parameters": {}} trailing', (' {"name": "w", "parameters": {}} trailing', [])),
    ("llama3_json", '{"name": "w", "parameters": {"city": "Pa', ('{"name": "w", "parameters": {"city": "Pa', [])),
    ("llama3_json", "The answer is {x}.", ("The answer is {x}.", [])),
    ("llama3_json", '{"answer": 4}', ('{"answer": 4}', [])),
    # pythonic
    ("pythonic", '[get_weather(city="Paris"), f(x=1, y=[1, 2], z=None)]',
     (None, [("get_weather", {"city": "Paris"}), ("f", {"x": 1, "y": [1, 2], "z": None})])),
    ("pythonic", "  [f()]\n", (None, [("f", {})])),
    ("pythonic", "[f(1)]", ("[f(1)]", [])),
    ("pythonic", "[f(x=g())]", ("[f(x=g())]", [])),
    ("pythonic", '[f(x="a"), g(', ('[f(x="a"), g(', [])),
    ("pythonic", "Call [f(x=1)]", ("Call [f(x=1)]", [])),
    ("pythonic", "[1, 2]", ("[1, 2]", [])),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "w", "arguments": ' + W + '}, {"name": "v", "arguments": {}}]',
     (None, [("w", {"city": "Paris"}), ("v", {})])),
    ("mistral", "Checking.[TOOL_CALLS]w[ARGS]" + W + "[TOOL_CALLS]v[ARGS]{}",
     ("Checking.", [("w", {"city": "Paris"}), ("v", {})])),
    ("mistral", "[TOOL_CALLS]w[CALL_ID]abc123XYZ[ARGS]{}", (None, [("w", {})])),
    ("mistral", "[TOOL_CALLS]w[ARGS]{\"city\": ", ("[TOOL_CALLS]w[ARGS]{\"city\": ", [])),
    # granite
    ("granite", '<|tool_call|>[{"name": "w", "arguments": ' + W + '}]', (None, [("w", {"city": "Paris"})])),
    ("granite", 'Ok <|tool_call|>[{"name": "w", "arguments": {}}, {"name": "v", "arguments": {"b": true}}]',
     ("Ok", [("w", {}), ("v", {"b": True})])),
    ("granite", '<|tool_call|>[{"name": "w"', ('<|tool_call|>[{"name": "w"', [])),
    # phi4_mini_json
    ("phi4_mini_json", 'functools[{"name": "w", "arguments": ' + W + '}]', (None, [("w", {"city": "Paris"})])),
    ("phi4_mini_json", 'I will.functools[{"name": "w", "parameters": {}}, {"name": "v", "arguments": {}}]',
     ("I will.", [("w", {}), ("v", {})])),
    ("phi4_mini_json", 'functools[{"nam": "w"}]', ('functools[{"nam": "w"}]', [])),
]


def stream(parser_name: str, text: str, cuts) -> tuple:
    parser = tp.get_tool_parser(parser_name)
    streamer = tp.AutoToolStreamer(parser)
    bounds = [0] + sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    content = "".join(streamer.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    rest, calls = streamer.finish()
    return (content + rest) or None, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_extract_and_stream_at_every_cut(name, text, expected):
    assert calls_of(name, text) == expected
    for cut in range(len(text) + 1):
        assert stream(name, text, [cut]) == expected
    assert stream(name, text, range(len(text))) == expected


def test_content_before_a_call_is_sent_before_the_call_is_complete():
    s = tp.AutoToolStreamer(tp.get_tool_parser("mistral"))
    assert s.feed("Checking the weather. [TOOL") == "Checking the weather."
    assert s.feed("_CALLS]w[ARGS]{}") == ""
    assert s.finish()[0] == ""
    s = tp.AutoToolStreamer(tp.get_tool_parser("llama3_json"))
    assert s.feed("  ") == "" and s.feed("Hi") == "  Hi"  # not a lead "{": content flows


def test_registry_and_template_choice():
    assert {"hermes", "llama3_json", "pythonic", "mistral", "granite", "phi4_mini_json"} <= set(
        tp.tool_parser_names())
    assert tp.parser_for_template("{% for t in tools %}<tool_call>{% endfor %}")[0] == "hermes"
    assert tp.parser_for_template("{{ tools }} <|python_tag|>")[0] == "llama3_json"
    assert tp.parser_for_template("{{ tools }} [TOOL_CALLS]")[0] == "mistral"
    assert tp.parser_for_template("{{ tools }} <|tool_call|>")[0] == "granite"
    assert tp.parser_for_template("{{ tools }} functools[")[0] == "phi4_mini_json"
    assert tp.parser_for_template("{{ tools }} [func_name1(params_name1=params_value1)]")[0] == "pythonic"
    assert tp.parser_for_template("{{ messages }}")[0] == "hermes"  # no tools in the template: the fallback prompt
    name, why = tp.parser_for_template("{{ tools }} <tool_call> [TOOL_CALLS]")
    assert name is None and "several" in why
    assert tp.parser_for_template("{{ tools }}")[0] is None


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>",
                          "functools", "[ARGS]", '{"name": "f", "arguments": {}}', '{"name": "g", "parameters": {}}',
                          "[", "]", "{", "}", ";", ", ", "f(x=1)", " ", "\n", "Hi", "<", "tool"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(PIECES, max_size=10), cuts=st.lists(st.integers(0, 150), max_size=6),
       name=st.sampled_from(["hermes", "llama3_json", "pythonic", "mistral", "granite", "phi4_mini_json"]))
def test_stream_equals_extract_for_any_text_and_cuts(parts, cuts, name):
    text = "".join(parts)
    assert stream(name, text, cuts) == calls_of(name, text)
