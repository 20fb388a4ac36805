"""gpt-oss's harmony channels: the ``openai_gptoss`` reasoning parser (analysis -> reasoning, final -> content) and
the ``openai`` tool parser (``commentary to=functions.NAME`` -> calls); each finished text's split, and the
streamed pieces equal to it at every cut point and for any text (hypothesis), alone and chained (the reasoning
parser's content is what the tool parser reads)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai import tool_parsers as tp
from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser, harmony_header
from tests.entrypoints.test_reasoning_parsers import stream as stream_reasoning
from tests.entrypoints.test_tool_parsers import calls_of, raw_calls, stream as stream_tools

A = "<|channel|>analysis<|message|>"
F = "<|start|>assistant<|channel|>final<|message|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'

REASONING_CASES = [
    (A + "User asks 2+2.<|end|>" + F + "It is 4.", ("User asks 2+2.", "It is 4.")),
    (A + "Think<|end|>" + F + "Done.<|return|>", ("Think", "Done.")),
    (A + "cut while thinking", ("cut while thinking", None)),
    ("<|channel|>final<|message|>Only an answer.", (None, "Only an answer.")),
    ("Plain text, no channels.", (None, "Plain text, no channels.")),
    (A + "Need weather.<|end|>" + CALL + "<|call|>", ("Need weather.", CALL + "<|call|>")),
    (A + "a <|constrain|> b<|end|>" + F + "x", ("a <|constrain|> b", "x")),
    (A + "r<|end|><|start|>assistant<|channel|>fin", ("r", "<|start|>assistant<|channel|>fin")),
    (A + "r<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>",
     ("r", "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>")),
]


@pytest.mark.parametrize("text,expected", REASONING_CASES)
def test_reasoning_split_and_every_cut(text, expected):
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.special_tokens and parser.extract(text) == expected
    for cut in range(len(text) + 1):
        assert stream_reasoning(parser, text, [cut]) == expected
    assert stream_reasoning(parser, text, list(range(len(text)))) == expected


W = {"city": "Paris"}
TOOL_CASES = [
    (CALL + "<|call|>", (None, [("get_weather", W)])),
    (CALL, (None, [("get_weather", W)])),  # <|call|> is a stop token: the text may end at the body
    ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
     (None, [("get_weather", W)])),
    ("Checking." + CALL + "<|call|>" + CALL.replace("get_weather", "get_time") + "<|call|>",
     ("Checking.", [("get_weather", W), ("get_time", W)])),
    # broken after its arguments' "{": the call stands with what was read, the rest is content (tool_scan's rule)
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json}<|call|>",
     ("not json}<|call|>", [("f", "{")])),
    ("It is 4.", ("It is 4.", [])),
    ("<|channel|>commentary to=functions.f<|message|>[1]", ("<|channel|>commentary to=functions.f<|message|>[1]", [])),
]


@pytest.mark.parametrize("text,expected", TOOL_CASES)
def test_tool_calls_and_every_cut(text, expected):
    assert tp.get_tool_parser("openai").special_tokens
    assert calls_of("openai", text) == expected
    whole = raw_calls("openai", text)
    for cut in range(len(text) + 1):
        assert stream_tools("openai", text, [cut]) == whole
    assert stream_tools("openai", text, range(len(text))) == whole


def test_reasoning_then_tools_reads_a_whole_harmony_turn():
    text = A + "The user wants the weather in Paris.<|end|>" + CALL + "<|call|>"
    reasoning, content = get_reasoning_parser("openai_gptoss").extract(text)
    assert reasoning == "The user wants the weather in Paris."
    assert calls_of("openai", content) == (None, [("get_weather", W)])


def test_headers():
    assert harmony_header("<|channel|>commentary to=functions.f <|constrain|>json") == ("commentary", "functions.f")
    assert harmony_header("<|start|>assistant to=functions.g<|channel|>commentary json") == (
        "commentary", "functions.g")
    assert harmony_header("<|start|>assistant<|channel|>final") == ("final", None)
    assert tp.parser_for_template("{{ tools }} <|call|>")[0] == "openai"


PIECES = st.sampled_from(["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                          "<|constrain|>", "assistant", "analysis", "final", "commentary", " to=functions.f", "json",
                          '{"a": 1}', "<|", "|>", "<", "Hi", " ", "\n"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_stream_equals_extract_for_any_text_and_cuts(parts, cuts):
    text = "".join(parts)
    parser = get_reasoning_parser("openai_gptoss")
    assert stream_reasoning(parser, text, cuts) == parser.extract(text)
    assert stream_tools("openai", text, cuts) == calls_of("openai", text)
    assert json.dumps(calls_of("openai", text)[1])  # calls are JSON objects


# ------------------------------------------------------------------------------------------------- on a server
@pytest.fixture(scope="module")
def harmony_server():
    from tests.entrypoints.conftest import LiveServer
    from kvserve.entrypoints.openai.serving_options import ServingOptions

    s = LiveServer(num_kv_blocks=64, max_num_seqs=4, max_model_len=1024, server_kwargs={"options": ServingOptions(
        reasoning_parser="openai_gptoss", tool_call_parser="openai", enable_auto_tool_choice=True)})
    yield s.start()
    s.stop()


@pytest.mark.real_model
@pytest.mark.server
@pytest.mark.parametrize("text, want", [
    (A + "Add them.<|end|>" + F + "Four.", ("Add them.", "Four.", [])),
    (A + "Need weather." + "<|end|>" + CALL, ("Need weather.", None, [("get_weather", W)])),
])
def test_a_harmony_turn_through_the_api(harmony_server, text, want):
    """SmolLM2 forced to a harmony text (a regex structured output; the markers are plain text to its tokenizer):
    the API returns its analysis as reasoning, its final channel as content, its commentary call as a tool call,
    streamed equal to non-streamed."""
    import openai

    from tests.entrypoints.test_parsers_server import WEATHER, regex_of, stream

    c = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=harmony_server.llm_model_name, messages=[{"role": "user", "content": "Hi"}], tools=WEATHER,
              temperature=0, max_tokens=120, extra_body={"guided_regex": regex_of(text)})
    m = c.chat.completions.create(**kw).choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
    assert ((m.model_extra or {}).get("reasoning_content"), m.content, calls) == want
    reasoning, content, streamed, _ = stream(c, **kw)
    assert (reasoning, content, [(n, json.loads(a)) for n, a in streamed.values()]) == want


@pytest.mark.real_model
@pytest.mark.server
def test_the_harmony_parsers_keep_special_tokens_unless_the_request_says(harmony_server):
    """The markers are special tokens in gpt-oss's vocabulary: a request read by a parser with ``special_tokens``
    is detokenized with them (``skip_special_tokens`` false) unless it sets ``skip_special_tokens`` itself."""
    from kvserve.entrypoints.openai import protocol as p

    serving = harmony_server.server.config.app.state.openai_serving_chat
    msgs = [{"role": "user", "content": "Hi"}]

    def skip(reasoning_name=None, tools=False, **fields):
        req = p.ChatCompletionRequest(model=harmony_server.llm_model_name, messages=msgs, **fields)
        reasoning = get_reasoning_parser(reasoning_name) if reasoning_name else None
        return serving.sampling_params(req, 16, None, None, None, reasoning, tools).skip_special_tokens

    assert skip("openai_gptoss") is False and skip(tools=True) is False
    assert skip("openai_gptoss", skip_special_tokens=True) is True
    assert skip("qwen3") is True and skip() is True
