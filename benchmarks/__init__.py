"""Experiments and measurements of kvserve, outside the package: run them from the repository root with the
project's environment, ``.venv/bin/python -m benchmarks.<name> --help``. What each measured is in ``docs/``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Optional


def engine_main(name: str, doc: str, add_args: Callable, run: Callable, argv: Optional[list] = None,
                skip: tuple = (), pass_engine_kwargs: bool = False) -> int:
    """The command line of ``python -m benchmarks.<name>``: the engine flags (``kvserve.engine.arg_utils``, less
    ``skip``) and the benchmark's own (``add_args``), then ``run(args)`` (or ``run(args, engine_kwargs)``); a
    ``ValueError`` is printed as ``error: ...`` with exit code 2."""
    from kvserve.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.split("\n\n")[0])
    add_engine_args(p, skip=skip)
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args, engine_kwargs(args)) if pass_engine_kwargs else run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
