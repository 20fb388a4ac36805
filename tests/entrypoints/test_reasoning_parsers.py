"""Reasoning parsers: each family's split of a finished text, and the streamed pieces equal to it at every cut."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.reasoning_parsers import (get_reasoning_parser, held_suffix,
                                                          reasoning_parser_names)


def stream(parser, text: str, cuts: list[int]) -> tuple:
    """Feed ``text`` cut at ``cuts``; returns the joined ``(reasoning, content)`` (``None`` when empty)."""
    s = parser.streamer()
    bounds = [0] + sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        pieces += s.feed(text[a:b])
    pieces += s.finish()
    assert all(kind in ("reasoning", "content") and piece for kind, piece in pieces)
    joined = {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
    return joined["reasoning"] or None, joined["content"] or None


CASES = [
    # parser, prompt, chat_template_kwargs, text, (reasoning, content)
    ("deepseek_r1", None, None, "<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    ("deepseek_r1", None, None, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    ("deepseek_r1", None, None, "Still thinking", ("Still thinking", None)),
    ("deepseek_r1", None, None, "<think>a</think>", ("a", None)),
    ("deepseek_r1", None, None, "</think>b<think>c</think>", (None, "b<think>c</think>")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, "x</think>\n\ny", ("x", "\n\ny")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, "Just 4.", (None, "Just 4.")),
    ("qwen3", "q", {"enable_thinking": False}, "Just 4. </think>", (None, "Just 4. </think>")),
    ("qwen3", "q", {"enable_thinking": True}, "<think>r</think>c", ("r", "c")),
    ("smollm3", "<|im_start|>system\n/no_think<|im_end|>", None, "<think>x</think>y", (None, "<think>x</think>y")),
    ("smollm3", "<|im_start|>system\n/think<|im_end|>", None, "<think>x</think>y", ("x", "y")),
    ("smollm3", "sys", {"enable_thinking": False}, "plain", (None, "plain")),
    ("deepseek_r1", "constrained", None, "<think>r</think>c", ("r", "c")),
    ("deepseek_r1", "constrained", None, '{"a": "<think>"}', (None, '{"a": "<think>"}')),
    ("qwen3", "constrained", None, "<thin", (None, "<thin")),
    ("qwen3", "constrained", None, "<think>r", ("r", None)),
    ("qwen3", "constrained", {"enable_thinking": False}, "<think>r</think>c", (None, "<think>r</think>c")),
    ("granite", None, None, "Here is my thought process: r. Here is my response: c.", (" r. ", " c.")),
    ("granite", None, None, "  Here's my thought process:r Here's my response:c", ("r ", "c")),
    ("granite", None, None, "Here is my thought process: only", (" only", None)),
    ("granite", None, None, "Hello. Here is my thought process: x", (None, "Hello. Here is my thought process: x")),
    ("granite", None, None, "Here is", (None, "Here is")),
]


@pytest.mark.parametrize("name,prompt,kwargs,text,expected", CASES)
def test_extract_and_every_cut(name, prompt, kwargs, text, expected):
    constrained = prompt == "constrained"
    parser = get_reasoning_parser(name, None if constrained else prompt, kwargs, constrained)
    assert parser.extract(text) == expected
    for cut in range(len(text) + 1):  # every single cut point, and one character a delta
        assert stream(parser, text, [cut]) == expected
    assert stream(parser, text, list(range(len(text)))) == expected


def test_registry_has_vllms_names_and_refuses_unknown():
    assert {"deepseek_r1", "qwen3", "granite", "smollm3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="reasoning parser 'nope' is not registered"):
        get_reasoning_parser("nope")


def test_marker_split_across_deltas_is_held_back_never_leaked():
    s = get_reasoning_parser("deepseek_r1").streamer()
    assert s.feed("abc</th") == [("reasoning", "abc")]
    assert s.feed("ink>de") == [("content", "de")]
    assert s.finish() == []
    g = get_reasoning_parser("granite").streamer()
    assert g.feed("Here is my tho") == []
    assert g.feed("ught process: r Here is my") == [("reasoning", " r ")]
    assert g.feed(" answer") == [("reasoning", "Here is my answer")]


def test_held_suffix():
    assert held_suffix("abc</thi", ("</think>",)) == 5
    assert held_suffix("abc<", ("<think>", "</think>")) == 1
    assert held_suffix("abc", ("</think>",)) == 0


ALPHABET = st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "Here is my ",
                            "thought process:", "response:", "Here's my ", "H"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(ALPHABET, max_size=12), cuts=st.lists(st.integers(0, 120), max_size=8),
       name=st.sampled_from(["deepseek_r1", "qwen3", "smollm3", "granite"]),
       prompt=st.sampled_from([None, "<think>\n", "<think>\n\n</think>\n"]), constrained=st.booleans())
def test_streamed_equals_extract_at_any_cuts(parts, cuts, name, prompt, constrained):
    text = "".join(parts)
    parser = get_reasoning_parser(name, prompt, None, constrained)
    assert stream(parser, text, cuts) == parser.extract(text)
