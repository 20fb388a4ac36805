"""Engine arguments on the command line, generated from the config dataclasses' fields.

Each field of ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig`` and ``KernelConfig`` becomes a flag
(``max_num_seqs`` -> ``--max-num-seqs``; bools get ``--x`` / ``--no-x``) whose default, type, choices and help come
from the field itself, so they are written once (vLLM's ``EngineArgs`` plays the same role). ``--speculative-config`` takes a
JSON object (``SpeculativeConfig``'s keys). Every subcommand and benchmark imports this module, never the CLI.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, fields

from kvserve.config import ENGINE_CONFIGS
_TYPES = {"int": int, "str": str, "float": float}


def _base_type(annotation: str) -> str:
    """``"Optional[int]"`` -> ``"int"`` (annotations are strings under ``from __future__ import annotations``)."""
    return annotation.removeprefix("Optional[").removesuffix("]")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple = ()) -> None:
    """Add one flag per engine config field (except the names in ``skip``) and ``--speculative-config``."""
    g = parser.add_argument_group("engine")
    for cls in ENGINE_CONFIGS:
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = None if f.default is MISSING else f.default
            help_text = f.metadata.get("help", "")
            if "default" not in help_text:
                help_text += f" (default: {default})"
            help_text = help_text.replace("%", "%%")
            kind = _base_type(typing.cast(str, f.type))
            if kind == "bool":
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            else:
                g.add_argument(flag, type=_TYPES[kind], default=default, choices=f.metadata.get("choices"),
                               help=help_text)
    if "speculative_config" not in skip:
        g.add_argument("--speculative-config", type=_json_object, default=None,
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                            "(default: off)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments present in parsed ``args`` (``LLM(**engine_kwargs(args))``)."""
    names = [f.name for cls in ENGINE_CONFIGS for f in fields(cls)] + ["speculative_config"]
    return {k: getattr(args, k) for k in names if hasattr(args, k)}
