"""``kvserve serve``'s parser, CORS and metric-name flags (``ServingOptions``): parsing, checks, the tool parser
picked from a chat template."""

import argparse
import logging

import pytest

from kvserve.entrypoints.openai import serving_options
from kvserve.entrypoints.openai.serving_options import ServingOptions


def parse(*argv) -> ServingOptions:
    p = argparse.ArgumentParser()
    serving_options.add_args(p)
    return ServingOptions.from_args(p.parse_args(list(argv)))


def test_flags_with_vllms_names_and_formats():
    o = parse("--reasoning-parser", "qwen3", "--tool-call-parser", "mistral", "--enable-auto-tool-choice",
              "--allowed-origins", '["https://a.example"]', "--allow-credentials", "--vllm-metric-names",
              "--thinking-token-budget", "64")
    assert (o.reasoning_parser, o.tool_call_parser, o.enable_auto_tool_choice, o.vllm_metric_names,
            o.thinking_token_budget) == ("qwen3", "mistral", True, True, 64)
    assert o.cors() == {"allow_origins": ["https://a.example"], "allow_methods": ["*"], "allow_headers": ["*"],
                        "allow_credentials": True}
    assert parse().cors() is None  # CORS off by default


@pytest.mark.parametrize("argv", [["--reasoning-parser", "nope"], ["--tool-call-parser", "nope"],
                                  ["--allowed-origins", "*"], ["--allowed-origins", '{"a": 1}']])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


@pytest.mark.parametrize("kw,msg", [({"reasoning_parser": "x"}, "reasoning_parser"),
                                    ({"thinking_token_budget": -1}, "thinking_token_budget"),
                                    ({"allowed_origins": [1]}, "allowed_origins")])
def test_bad_values_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ServingOptions(**kw)


def test_the_tool_parser_from_the_chat_template_is_logged(caplog):
    o = ServingOptions(enable_auto_tool_choice=True)
    with caplog.at_level(logging.INFO, logger="kvserve.entrypoints.openai.serving_options"):
        assert o.resolve_tool_parser("{% for t in tools %}{{ t }}{% endfor %}[TOOL_CALLS]") == "mistral"
    assert "tool-call parser: mistral" in caplog.text and "[TOOL_CALLS]" in caplog.text
    assert o.resolve_tool_parser("{{ tools }}") is None  # ambiguous: --tool-call-parser must say
    assert ServingOptions(tool_call_parser="granite").resolve_tool_parser("{{ tools }} <tool_call>") == "granite"
