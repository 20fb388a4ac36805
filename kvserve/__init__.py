"""kvserve: an LLM inference serving engine (PagedAttention, continuous batching, preemption)."""

from kvserve.entrypoints.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
