"""The event model (model-free): a choice's text cut into deltas at every point gives the same events' fold, and
the same rendered Responses object and Anthropic message, as the whole text at once; the reasoning parsers'
streamed pieces join to their ``extract``; the Responses store's three bounds."""

import itertools
import json

import pytest

from kvserve.entrypoints.anthropic.serving_messages import MessageBuilder
from kvserve.entrypoints.events import (ChoiceEvents, Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta,
                                        ToolCallStart, fold)
from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from kvserve.entrypoints.openai.responses_store import ResponseStore, StoreLimits
from kvserve.entrypoints.openai.serving_chat import ToolChoice
from kvserve.entrypoints.openai.serving_responses import ResponseBuilder

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
HERMES = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK = "<think>The user wants a fruit.</think>A banana."


def cuts(text: str):
    """The whole text, every single cut, and every pair of cuts (short texts)."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    if len(text) <= 40:
        for i, j in itertools.combinations(range(1, len(text)), 2):
            yield [text[:i], text[i:j], text[j:]]


def run(pieces, tools=None, reasoning=None, finish="stop", stop_reason=None):
    ce = ChoiceEvents(0, tools() if tools else None, get_reasoning_parser(reasoning) if reasoning else None)
    events = ce.head()
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        events += ce.feed(piece, finish if last else None, stop_reason if last else None)
    return events


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in ("id", "call_id", "item_id")}
    if isinstance(obj, (list, tuple)):
        return [strip(v) for v in obj]
    return obj


def rendered(events):
    rb = ResponseBuilder({"id": "r", "output": [], "status": "in_progress"})
    stream = rb.start()
    mb = MessageBuilder({"id": "m", "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": 1, "output_tokens": 0}}, ["STOP"])
    for e in events:
        stream += rb.feed(e)
        mb.feed(e)
    stream += rb.end({"output_tokens": 1})
    mb.end(1)
    assert stream[-1]["response"] == rb.response  # the streamed final object is the folded one
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    return strip(rb.response), strip(mb.message)


#: Qwen3's prompt ends: thinking on (the model opens ``<think>`` itself, or the template opened it in the prompt),
#: and thinking off (``enable_thinking: false``: the template closes an empty think block in the prompt).
QWEN3_ON = "<|im_start|>user\nA fruit?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OPENED = QWEN3_ON + "<think>\n"
QWEN3_OFF = QWEN3_ON + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("name, prompt, text, reasoning, content", [
    ("deepseek_r1", None, THINK, "The user wants a fruit.", "A banana."),
    ("deepseek_r1", None, "thinking with the tag in the prompt</think>answer", "thinking with the tag in the prompt",
     "answer"),
    ("deepseek_r1", None, "still thinking", "still thinking", None),
    ("qwen3", QWEN3_ON, THINK, "The user wants a fruit.", "A banana."),
    ("qwen3", QWEN3_OPENED, "opened in the prompt</think>answer", "opened in the prompt", "answer"),
    ("qwen3", QWEN3_OFF, "no thinking at all", None, "no thinking at all"),
    ("qwen3", QWEN3_OFF, "<thin", None, "<thin"),
    ("qwen3", QWEN3_ON, "<think>cut sho", "cut sho", None),
])
def test_reasoning_parsers_stream_what_they_extract(name, prompt, text, reasoning, content):
    """The prompt decides where the output starts (qwen3: a think block opened in the prompt, or closed there
    with thinking off); the streamed pieces join to ``extract`` at every cut."""
    parser = get_reasoning_parser(name, prompt)
    assert parser.extract(text) == (reasoning, content)
    for pieces in cuts(text):
        s = parser.streamer()
        out = [p for piece in pieces for p in s.feed(piece)] + s.finish()
        assert "".join(t for k, t in out if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in out if k == "content") == (content or "")


def test_unknown_reasoning_parser_lists_the_known():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("text, tools, reasoning", [
    (THINK, None, "deepseek_r1"),
    ("Plain answer, no tools.", None, None),
    (HERMES, lambda: ToolChoice.create(TOOLS, "auto"), None),
    ('{"city": "Paris"}', lambda: ToolChoice.create(TOOLS, {"type": "function", "function": {"name": "get_weather"}}),
     None),
    ('[{"name": "get_weather", "arguments": {"city": "Rome"}}]', lambda: ToolChoice.create(TOOLS, "required"), None),
])
def test_every_cut_point_gives_the_same_answer(text, tools, reasoning):
    whole = run([text], tools, reasoning)
    expected = strip(vars(fold(whole)))
    expected_render = rendered(whole)
    for pieces in cuts(text):
        events = run(pieces, tools, reasoning)
        assert strip(vars(fold(events))) == expected, pieces
        assert rendered(events) == expected_render, pieces


#: each parser's call text, with content before (and, where the format allows, after) the calls
SAMPLES = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\nDone.',
    "llama3_json": 'Ok.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    "pythonic": '[get_weather(city="Paris", days=2), get_weather(city=\'Rome\')]',
    "mistral": 'Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"} ok',
    "granite": 'Ok. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_weather", "arguments": {"city": "Rome"}}] done',
    "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
}


@pytest.mark.parametrize("parser", sorted(SAMPLES))
def test_each_parser_streams_fragments_equal_to_the_whole_answer_in_every_api(parser):
    """Every single cut of each parser's sample (and its cut-short prefixes, every 7th) gives the same fold and the
    same Responses / Messages rendering as the whole text; one character per delta, the calls' arguments arrive
    in several fragments, each call's name first."""
    tools = lambda: ToolChoice.create(TOOLS, "auto", parser=parser)  # noqa: E731
    text = SAMPLES[parser]
    for end in list(range(1, len(text), 7)) + [len(text)]:
        whole = run([text[:end]], tools, finish="length" if end < len(text) else "stop")
        expected, expected_render = strip(vars(fold(whole))), rendered(whole)
        for i in range(1, end):
            pieces = [text[:end][:i], text[:end][i:]]
            events = run(pieces, tools, finish="length" if end < len(text) else "stop")
            assert strip(vars(fold(events))) == expected, (parser, pieces)
            assert rendered(events) == expected_render, (parser, pieces)
    answer = fold(run([text], tools))
    assert [(c["name"], json.loads(c["arguments"])["city"]) for c in answer.tool_calls][-1] == ("get_weather",
                                                                                               "Rome")
    assert answer.finish_reason == "tool_calls"
    events = run(list(text), tools)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    frags = [e for e in events if isinstance(e, ToolCallArgsDelta)]
    assert [e.index for e in starts] == list(range(len(answer.tool_calls)))
    assert len(frags) > len(starts) and all(events.index(s) < events.index(f) for s in starts[:1]
                                                  for f in frags if f.index == 0)


def test_fold_of_a_tool_call_and_the_renderings():
    answer = fold(run([HERMES], lambda: ToolChoice.create(TOOLS, "auto")))
    assert answer.text == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in answer.tool_calls] == [("get_weather",
                                                                                     {"city": "Paris"})]
    assert answer.finish_reason == "tool_calls"
    response, message = rendered(run([HERMES], lambda: ToolChoice.create(TOOLS, "auto")))
    assert [o["type"] for o in response["output"]] == ["message", "function_call"]
    assert response["status"] == "completed"
    assert message["content"] == [{"type": "text", "text": "Let me look."},
                                  {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    assert message["stop_reason"] == "tool_use"


def test_reasoning_then_text_renders_in_order():
    response, message = rendered(run([THINK], reasoning="deepseek_r1", finish="stop", stop_reason="STOP"))
    assert [o["type"] for o in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants a fruit."}]
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP")


def test_length_is_incomplete_and_max_tokens():
    response, message = rendered([TextDelta("abc"), Finish("length")])
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert message["stop_reason"] == "max_tokens"
    response, _ = rendered([ReasoningDelta("x")])  # no Finish: the request was cancelled
    assert response["status"] == "cancelled"


def test_store_bounds_entries_bytes_and_ttl():
    now = [0.0]
    store = ResponseStore(StoreLimits(responses_store_max_entries=2, responses_store_max_bytes=10_000,
                                      responses_store_ttl=60), clock=lambda: now[0])
    for i in range(3):
        assert store.put({"id": f"r{i}", "output": []}, [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    assert not store.put({"id": "big", "output": ["x" * 20_000]}, [])  # alone over the byte bound: not kept
    assert store.get("big") is None and len(store) == 2
    small = ResponseStore(StoreLimits(responses_store_max_entries=100, responses_store_max_bytes=100,
                                      responses_store_ttl=60), clock=lambda: now[0])
    for i in range(5):
        small.put({"id": f"s{i}", "output": []}, [{"role": "user", "content": "hello"}])
    assert small.nbytes <= 100 and small.get("s4") is not None and small.get("s0") is None
    now[0] = 61.0
    assert store.get("r2") is None and len(store) == 0 and store.nbytes == 0
    assert store.delete("r2") is False
