"""``kvserve`` command line (dispatch only; engine flags come from ``kvserve.engine.arg_utils``): ``kvserve generate``
(the main job), ``kvserve serve`` (the HTTP server), ``kvserve bench throughput`` / ``kvserve bench serve``,
``kvserve sim`` (and ``sim profile``) and ``kvserve plan``. Only the command named on the command line imports its
modules (``_COMMANDS``, ``_BENCH``). Experiments live outside the package, in ``benchmarks/``."""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import sys

from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
from kvserve.extras import MissingExtraError, require


# Each command's set-up adds its flags to its parser and returns its runner (``args -> exit code``). It imports the
# command's modules, and only the command named on the command line is set up: ``kvserve generate`` never imports
# the server (fastapi, uvicorn, pydantic, prometheus_client), the simulator or the benchmarks (docs/performance.md,
# start-up and memory). ``kvserve --help`` lists every command from the help strings below.


def _generate(p):
    from kvserve.entrypoints import generate_cmd

    add_engine_args(p)
    generate_cmd.add_args(p)
    return generate_cmd.run


def _serve(p):
    for module in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):  # the [server] extra
        require(module, "server", "kvserve serve")
    from kvserve.entrypoints.ray import args as ray_serve_args
    from kvserve.entrypoints.openai import api_server

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's positional form (the same as --model; default: SmolLM2-135M-Instruct)")
    add_engine_args(p)
    api_server.add_args(p)
    ray_serve_args.add_args(p)

    def run(args):
        args.model = model_from(args)
        if ray_serve_args.wants_ray(args):
            return ray_serve_args.run(args, engine_kwargs(args))
        return api_server.run(args, engine_kwargs(args))
    return run


def model_from(args: argparse.Namespace):
    """The model of ``kvserve serve [MODEL] [--model M]``: either form, or both when they agree.

    Raises:
        ValueError: both are given and differ.
    """
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"model: the positional MODEL ({args.model_tag!r}) and --model ({args.model!r}) differ; "
                         "give one")
    return args.model if args.model is not None else args.model_tag


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (``(default: X)``) unless the help already names one, as
    ``argparse.ArgumentDefaultsHelpFormatter`` does, without saying it twice."""

    def _format_action(self, action):
        if not action.help and _shows_default(action):  # argparse prints no help line for help=None
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should name ``action``'s default: an option with a value, not ``--help`` itself."""
    return bool(action.option_strings) and action.default is not argparse.SUPPRESS


def _bench(module: str, engine: bool = True):
    """The set-up of ``kvserve bench <name>`` from ``kvserve.bench.<module>`` (``add_args``, ``run``), with the
    engine flags when ``engine``."""
    def setup(p):
        mod = importlib.import_module(f"kvserve.bench.{module}")
        if engine:
            add_engine_args(p)
        mod.add_args(p)
        return mod.run
    return setup


def _sim(p):
    from kvserve.sim import cli as sim_cli

    sim_cli.add_args(p)
    sim_sub = p.add_subparsers(dest="sim_command")
    sim_cli.add_profile_args(sim_sub.add_parser("profile", help="time real engine steps and save the cost-model "
                                                                "profile (JSON)", formatter_class=HelpFormatter))

    def run(args):
        return sim_cli.run_profile(args) if args.sim_command == "profile" else sim_cli.run(args)
    return run


def _plan(p):
    from kvserve.sim import plan as sim_plan

    sim_plan.add_args(p)
    return sim_plan.run


_COMMANDS = {  # name -> (help, set-up); "bench" groups _BENCH
    "generate": ("generate answers for chat prompts (default: the built-in set)", _generate),
    "serve": ("OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)", _serve),
    "bench": ("benchmarks", None),
    "sim": ("simulate a trace on the real scheduler with a measured step-cost model", _sim),
    "plan": ("capacity planner: the settings with the highest simulated goodput under SLOs", _plan),
}
_BENCH = {  # kvserve bench <name> -> (help, set-up)
    "throughput": ("offline throughput: static vs continuous (vs transformers)", _bench("throughput")),
    "serve": ("load-test a running kvserve server over HTTP (TTFT, TPOT, ITL, goodput)", _bench("serve", engine=False)),
}


def _add_bench(bench: argparse.ArgumentParser, chosen):
    """``kvserve bench``'s subcommands; sets up only ``chosen`` and returns its runner (``None`` if none is)."""
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    runner = None
    for name, (help_text, setup) in _BENCH.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == chosen:
            runner = setup(p)
    return runner


def main(argv=None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); returns its exit code (2: a bad argument or a
    missing optional package, with the message on stderr)."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except MissingExtraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser(argv: list):
    """The ``kvserve`` parser for ``argv`` and the runner of the command it names (``None`` if none): only that
    command's flags are set up (a sibling command's parser is left empty)."""
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged-KV, continuously batched LLM engine",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    command = argv[0] if argv else None
    runner = None
    for name, (help_text, setup) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if name == "bench":
            runner = _add_bench(p, argv[1] if command == "bench" and len(argv) > 1 else None) or runner
        elif name == command:
            runner = setup(p)
    return parser, runner


def _main(argv: list) -> int:
    parser, runner = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if runner is None:
        return 1
    try:
        return runner(args)
    except ValueError as e:
        print(f"error: {_with_flag(str(e), args)}", file=sys.stderr)
        return 2


def _with_flag(message: str, args: argparse.Namespace) -> str:
    """``message`` led by the command-line flag it is about when it starts with a field's name that is also one of
    the command's flags (``max_tokens must be ...`` -> ``--max-tokens: max_tokens must be ...``): the engine names
    its fields, a user of the CLI typed the flag. A flag left unset (``None``) is not named: the value came from
    elsewhere (a ``prompt`` read from ``--prompts-file`` is not ``--prompt``'s)."""
    field = message.split(" ", 1)[0].rstrip(":")
    if field.isidentifier() and vars(args).get(field) is not None:
        return f"--{field.replace('_', '-')}: {message}"
    return message


if __name__ == "__main__":
    sys.exit(main())
