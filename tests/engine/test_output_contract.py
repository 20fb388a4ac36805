"""Offline halves of issue 13's output contract on the real model: ``min_tokens`` holds back every stop
mechanism alike, text that is not valid Unicode is a ``ValueError`` (exit status 2 on the CLI), one chat-message
rule, and single tokens named from the vocabulary (bytes, names, text offsets)."""

import json
import subprocess
import sys

import pytest

from kvserve import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer, TokenVocab
from tests.conftest import assert_pool_clean

PARIS = "The capital of France is"
FREE = " Paris.\n\nThe answer is:"  # a text for the detokenizer test: " Paris", ".", "\n", "\n", ...
PARIS_PERIOD = [7042, 30]  # " Paris", "."
PERIOD = 30  # "."


def _one(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, **kw))[0].outputs[0]


def test_min_tokens_holds_back_stop_strings_like_stop_token_ids(llm):
    free = _one(llm, PARIS)
    # the setting the test needs from the model: greedy " Paris." first, then at least one more character
    assert free.token_ids[:2] == PARIS_PERIOD and len(free.token_ids) >= 3
    assert free.text.startswith(" Paris.") and len(free.text) > len(" Paris.")
    stopped = _one(llm, PARIS, stop=["."])
    assert (stopped.text, stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (" Paris", PARIS_PERIOD,
                                                                                          "stop", ".")
    # "." is the 2nd token: with min_tokens 2 or 3 it does not count, whatever the mechanism
    for min_tokens in (2, 3):
        held = _one(llm, PARIS, stop=["."], min_tokens=min_tokens)
        assert (held.text, held.token_ids, held.finish_reason) == (free.text, free.token_ids, free.finish_reason)
    by_id = _one(llm, PARIS, stop_token_ids=[PERIOD], min_tokens=3)
    assert PERIOD not in by_id.token_ids[:3]  # suppressed in the sampler (so the text differs)
    # min_tokens 1: the 2nd token may stop, as a stop string and as a stop token id
    assert _one(llm, PARIS, stop=["."], min_tokens=1).token_ids == PARIS_PERIOD
    assert _one(llm, PARIS, stop_token_ids=[PERIOD], min_tokens=1).token_ids == PARIS_PERIOD
    # a stop string completed by a later token counts, even when it starts in the held-back text: "." and the
    # character after it (the first of the 3rd token's text)
    stop = "." + free.text[len(" Paris.")]
    straddle = _one(llm, PARIS, stop=[stop], min_tokens=2)
    assert (straddle.text, straddle.token_ids, straddle.stop_reason) == (" Paris", free.token_ids[:3], stop)
    assert_pool_clean(llm.llm_engine)


def test_detokenizer_stop_floor(tokenizer):
    ids = tokenizer.encode(FREE)
    d = IncrementalDetokenizer(tokenizer, stop=["."], min_tokens=2)
    assert [d.add_token(t) for t in ids[:2]] == [None, None] and d.text == " Paris."
    d = IncrementalDetokenizer(tokenizer, stop=["answer"], min_tokens=2)
    assert [d.add_token(t) for t in ids].count("answer") == 1 and d.text == " Paris.\n\nThe "


SURROGATE = "hi \ud800"


def test_lone_surrogates_are_value_errors_offline(llm):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate(SURROGATE, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate(["fine", SURROGATE], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"messages\[0\]\.content is not valid Unicode"):
        llm.chat([{"role": "system", "content": SURROGATE}, {"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.text is not valid Unicode"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}])
    with pytest.raises(ValueError, match="stop is not valid Unicode"):
        SamplingParams(stop=["ok", SURROGATE])
    assert_pool_clean(llm.llm_engine)  # nothing was left queued


def test_cli_prompts_file_with_a_lone_surrogate_exits_2(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": SURROGATE}) + "\n")  # ASCII JSON: "\ud800"
    r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "generate", "--prompts-file", str(path),
                        "--max-tokens", "2", "--num-kv-blocks", "16", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: prompt is not valid Unicode")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"needs a 'text' string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"messages\[0\]\.tool_calls is only allowed in an assistant"),
    ([{"role": "user", "content": "x", "colour": "red"}], "unrecognized message field"),
    ([], "non-empty list"),
])
def test_one_message_rule_offline(llm, messages, where):
    with pytest.raises(ValueError, match=where):
        llm.apply_chat_template(messages)


def test_assistant_null_content_and_text_parts_render_like_strings(llm):
    plain = llm.apply_chat_template([{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}])
    parts = llm.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                     {"role": "assistant", "content": None}])
    assert parts == plain


def test_reasoning_sent_back_reaches_the_template_as_reasoning_content(llm):
    """An assistant's ``reasoning`` (vLLM's newer name) or ``reasoning_content`` is the template's
    ``reasoning_content`` (Qwen3-style templates read it); on another role it is refused naming the field."""
    template = "{% for m in messages %}[{{ m.get('reasoning_content', '-') }}]{% endfor %}"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "why"},
            {"role": "assistant", "content": "b", "reasoning_content": "how"}]
    assert llm.apply_chat_template(msgs, add_generation_prompt=False, chat_template=template) == "[-][why][how]"
    with pytest.raises(ValueError, match=r"messages\[0\]\.reasoning must be a string, in an assistant message"):
        llm.apply_chat_template([{"role": "user", "content": "q", "reasoning": "x"}])


def test_token_vocab_bytes_names_and_offsets(tokenizer):
    vocab = TokenVocab(tokenizer)
    text = "Hi \U0001F355\U0001F354 caf\u00e9. done"
    ids = tokenizer.encode(text)
    assert ids == [26843, 15107, 231, 239, 10813, 231, 238, 37366, 30, 2294]
    assert [vocab.token_name(t) for t in ids] == ["Hi", " \\xf0\\x9f", "\\x8d", "\\x95", "\\xf0\\x9f", "\\x8d",
                                                   "\\x94", " caf\u00e9", ".", " done"]
    assert b"".join(vocab.token_bytes(t) for t in ids) == text.encode("utf-8")
    offsets, end = vocab.text_offsets(ids)
    assert offsets == [0, 2, 3, 3, 4, 4, 4, 5, 10, 11] and end == len(text)
    assert all(text[o:].startswith(vocab.token_name(t)) for o, t in zip(offsets, ids) if "\\x" not in
               vocab.token_name(t))
    # in two pieces (a stream): the same offsets
    first, mid = vocab.text_offsets(ids[:3], 7)
    rest, _ = vocab.text_offsets(ids[3:], mid)
    assert first + rest == [o + 7 for o in offsets]
    # special tokens: their text as bytes, no text when skipped
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert vocab.token_name(im_end) == "<|im_end|>"
    assert vocab.text_offsets([im_end, ids[0]], 0, skip_special_tokens=True) == ([0, 0], 2)
    assert vocab.text_offsets([im_end, ids[0]], 0, skip_special_tokens=False) == ([0, 10], 12)


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "ignore_eos", "skip_special_tokens"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_sampling_params_flags_are_booleans(field, value):
    with pytest.raises(ValueError, match=f"{field} must be true or false"):
        SamplingParams(**{field: value})
