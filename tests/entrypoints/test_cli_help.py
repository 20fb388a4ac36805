"""The command line's vLLM names and its ``--help``: every option of every subcommand names its default;
``kvserve serve MODEL`` (positional, as vLLM); ``bench serve``'s ``--dataset-name``, ``--save-result``,
``--result-dir`` and ``--ignore-eos`` off by default."""

import argparse

import pytest

from kvserve.bench.serve import result_paths
from kvserve.entrypoints.cli import HelpFormatter, build_parser, main, model_from

pytest.importorskip("fastapi")  # kvserve serve's parser needs the [server] extra

#: every command path of ``kvserve``
COMMANDS = [["generate"], ["serve"], ["bench", "throughput"], ["bench", "serve"], ["sim"], ["sim", "profile"],
            ["plan"]]


def _subparser(parser: argparse.ArgumentParser, path: list) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return " ".join(HelpFormatter(parser.prog)._format_action(action).split())


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_option_with_a_default_names_it_in_help(path):
    parser = _subparser(build_parser(path)[0], path)
    options = [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS]
    assert len(options) >= 3, path
    missing = [a.option_strings[-1] for a in options if "default" not in _option_help(parser, a).lower()]
    assert missing == [], f"kvserve {' '.join(path)} --help hides the default of {missing}"
    assert "default" in parser.format_help()


def test_help_names_the_concrete_defaults():
    serve = _subparser(build_parser(["serve"])[0], ["serve"])
    text = " ".join(serve.format_help().split())
    assert "--port PORT port (0 = any free port) (default: 8000)" in text
    assert "--uvicorn-log-level {critical,error,warning,info,debug,trace} default: info" in text
    assert "--max-num-seqs MAX_NUM_SEQS" in text  # the engine flags come from the config dataclasses
    bench = _subparser(build_parser(["bench", "serve"])[0], ["bench", "serve"])
    text = " ".join(bench.format_help().split())
    assert "--temperature TEMPERATURE default: 0.0" in text and "--result-dir RESULT_DIR" in text


def test_serve_positional_model_and_model_flag():
    parser = build_parser(["serve"])[0]
    args = parser.parse_args(["serve", "m.gguf", "--port", "0"])
    assert (args.model_tag, args.model) == ("m.gguf", None) and model_from(args) == "m.gguf"
    assert model_from(parser.parse_args(["serve", "--model", "m.gguf"])) == "m.gguf"
    assert model_from(parser.parse_args(["serve", "m.gguf", "--model", "m.gguf"])) == "m.gguf"
    assert model_from(parser.parse_args(["serve"])) is None
    with pytest.raises(ValueError, match=r"positional MODEL \('a.gguf'\) and --model \('b.gguf'\) differ"):
        model_from(parser.parse_args(["serve", "a.gguf", "--model", "b.gguf"]))


def test_serve_positional_and_flag_differing_is_a_usage_error(capsys):
    assert main(["serve", "a.gguf", "--model", "b.gguf", "--port", "0"]) == 2
    assert "differ" in capsys.readouterr().err


def test_bench_serve_vllm_names(tmp_path):
    parser = build_parser(["bench", "serve"])[0]
    args = parser.parse_args(["bench", "serve", "--dataset-name", "sharegpt", "--save-result", "--result-dir",
                              str(tmp_path / "out"), "--result-filename", "r.json", "--request-rate", "2"])
    assert args.dataset == "sharegpt" and args.ignore_eos is False
    assert result_paths(args, "m") == [str(tmp_path / "out" / "r.json")] and (tmp_path / "out").is_dir()
    old = parser.parse_args(["bench", "serve", "--dataset", "azure", "--output-json", "x.json", "--ignore-eos"])
    assert old.dataset == "azure" and old.ignore_eos is True and result_paths(old, "m") == ["x.json"]
    named = parser.parse_args(["bench", "serve", "--save-result", "--result-dir", str(tmp_path)])
    (path,) = result_paths(named, "org/model")
    assert path.startswith(str(tmp_path / "kvserve-inf" "qps-org_model-")) and path.endswith(".json")
    assert result_paths(parser.parse_args(["bench", "serve"]), "m") == []
