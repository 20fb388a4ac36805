"""A request inside the engine: its tokens, its progress through the KV cache, its status and timestamps."""

from __future__ import annotations

import enum
import time
from typing import Optional

import torch

from kvserve.sample.state import SamplingState
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    #: parked by the scheduler while its prefix blocks are read from the disk tier (vLLM: WAITING_FOR_REMOTE_KVS)
    WAITING_FOR_KV_LOAD = "waiting_for_kv_load"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI's ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while unfinished."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    """One generation request.

    Attributes:
        request_id: unique id (str).
        prompt: the prompt text, or ``None`` when token ids were given.
        prompt_token_ids: list of int.
        output_token_ids: generated token ids so far.
        num_computed_tokens: tokens (prompt + output) whose K/V is in the cache. ``num_tokens -
            num_computed_tokens`` is what the scheduler still has to compute: the whole prompt at first, then 1
            per decode step, everything again after a preemption.
        max_total_tokens: the sequence may not grow past this (``max_model_len``), tokens.
        generator: a seeded ``torch.Generator`` when ``sampling_params.seed`` is set.
        sampling_state: the ``SamplingState`` the samplers see (params, token lists by reference, generator).
        grammar: its ``GrammarState`` when ``sampling_params.structured_outputs`` is set (one per sample, attached
            by the engine, advanced only by the scheduler), else ``None``.
        arrival_time, first_scheduled_time, first_token_time, finish_time: ``time.monotonic()`` seconds.
        num_preemptions: how often this request was preempted.
        priority: lower is more urgent (``scheduling_policy="priority"`` only).
        prompt_logprobs: vLLM's shape: ``None`` for the first prompt token, then ``{token_id: logprob}`` per prompt
            token scored so far (``SamplingParams.prompt_logprobs``); complete at ``num_prompt_tokens`` entries.
        prompt_logprob_ranks: the rank of each prompt token in its entry (``None`` for the first), parallel to
            ``prompt_logprobs``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list,
        sampling_params: SamplingParams,
        max_total_tokens: int,
        prompt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_total_tokens = max_total_tokens
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[Optional[dict[int, float]]] = [None]
        self.prompt_logprob_ranks: list[Optional[int]] = [None]
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason = None
        self.generator: Optional[torch.Generator] = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.sampling_state = SamplingState(request_id, sampling_params, self.prompt_token_ids,
                                            self.output_token_ids, self.generator)
        self.grammar = None  # a kvserve.structured.backend.GrammarState
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.num_preemptions = 0
        self.priority = priority
        self.fork_children: list[Request] = []  # the other samples of an n > 1 request, started after the prompt
        self.parent_id: Optional[str] = None  # the user's request id when this is one sample of several
        self.sample_index = 0
        self.block_hashes: list = []  # chained BlockHash of each full block (KVCacheManager.block_hashes)
        self.queue_seq = 0  # set by the scheduler: arrival order, the FCFS tie-break

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without concatenating the whole sequence."""
        p = self.num_prompt_tokens
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens} tok, out={len(self.output_token_ids)} tok, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
