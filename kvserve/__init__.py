"""kvserve: an LLM inference serving engine (PagedAttention, continuous batching, preemption).

The public API (``LLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``) is imported on first use
(PEP 562), so ``import kvserve.config`` or ``import kvserve.core.block_pool`` does not load the engine.
"""

from __future__ import annotations

import importlib

_API = {
    "LLM": "kvserve.entrypoints.llm",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
}
__all__ = list(_API)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
