"""``kvserve.model.chat_config`` without a model: which ids end generation (generation_config.json over config.json,
GGUF eos / eot / eom), refused ids, GGUF named templates, vLLM's ``--chat-template`` value (a file or the text),
and which template renders a conversation (``chat_utils.chat_template_for``)."""

import argparse
import json
from types import SimpleNamespace

import pytest

from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
from kvserve.entrypoints.chat_utils import NoChatTemplateError, chat_template_for
from kvserve.model.chat_config import (end_tokens, gguf_chat_templates, gguf_declared_end_tokens,
                                       hf_declared_end_tokens, load_chat_template)

TOKENIZER = SimpleNamespace(eos_token_id=7)


def test_generation_config_eos_list_wins_over_config_json(tmp_path):
    cfg = {"eos_token_id": 5}
    assert hf_declared_end_tokens(tmp_path, cfg) == {"config.json eos_token_id": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 3, 7]}))
    declared = hf_declared_end_tokens(tmp_path, cfg)
    assert declared == {"generation_config.json eos_token_id": [9, 3, 7]}
    assert end_tokens(declared, TOKENIZER, 10, "m") == (7, (3, 7, 9))  # the tokenizer's EOS is the primary
    assert end_tokens(declared, None, 10, "m") == (9, (3, 7, 9))  # weights only: the file's first
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json.*must hold a JSON object"):
        hf_declared_end_tokens(tmp_path, cfg)
    assert end_tokens({}, None, 10, "m") == (None, ())


def test_gguf_end_of_turn_keys_all_end_generation():
    fields = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 6, "tokenizer.ggml.eom_token_id": 4,
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.padding_token_id": 0}
    declared = gguf_declared_end_tokens(fields)
    assert declared == {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 6,
                        "tokenizer.ggml.eom_token_id": 4}
    assert end_tokens(declared, SimpleNamespace(eos_token_id=2), 8, "m") == (2, (2, 4, 6))


@pytest.mark.parametrize("value", [8, -1, True, "2", 2.0])
def test_an_end_token_outside_the_vocabulary_is_refused_by_source(value):
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id in 'm': .* not a token id in \[0, 8\)"):
        end_tokens({"generation_config.json eos_token_id": [2, value]}, None, 8, "'m'")


def test_gguf_named_templates_join_the_default_as_transformers_keeps_them():
    assert gguf_chat_templates({}) is None
    assert gguf_chat_templates({"tokenizer.chat_template": "A"}) == "A"
    assert gguf_chat_templates({"tokenizer.chat_template": "A", "tokenizer.chat_template.tool_use": "T",
                                "tokenizer.chat_template.rag": "R"}) == {"default": "A", "tool_use": "T", "rag": "R"}


def test_chat_template_value_is_a_file_or_the_text_and_is_checked(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(None) is None
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="chat_template 'nope.jinja' looks like a file path, but the file cannot be"):
        load_chat_template("nope.jinja")
    with pytest.raises(ValueError, match=r"chat_template: not a valid Jinja template \(line 1"):
        load_chat_template("{% for m in messages %}")


def test_the_chat_template_flag_is_an_engine_argument(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--chat-template", "t.jinja"]))["chat_template"] == "t.jinja"
    assert engine_kwargs(parser.parse_args([]))["chat_template"] is None


def test_which_template_renders_a_conversation():
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = SimpleNamespace(chat_template={"default": "D", "tool_use": "T"})
    assert chat_template_for(named) == "D" and chat_template_for(named, tools=tools) == "T"
    assert chat_template_for(SimpleNamespace(chat_template="D"), tools=tools) == "D"
    assert chat_template_for(named, "X", tools) == "X"  # --chat-template wins
    for tok in (SimpleNamespace(chat_template=None), SimpleNamespace(), SimpleNamespace(chat_template={"rag": "R"})):
        with pytest.raises(NoChatTemplateError, match="no chat template .* --chat-template FILE"):
            chat_template_for(tok)
