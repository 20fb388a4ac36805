"""The plan the scheduler hands down for one step, and what the model runner hands back.

A ``SchedulerOutput`` is self-contained: each ``ScheduledRequest`` carries the token ids to feed, where they
start, the block table, the drafts to verify and references to the sampling state of the samples it draws for, so
the model runner, the batch builder and the samplers never read a live ``Request`` (vLLM v1's
``core/sched/output.py`` draws the same line). ``ModelRunnerOutput`` has one field of tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.sample.state import SamplingState


@dataclass
class ScheduledRequest:
    """One request's share of a step, fixed at schedule time.

    Attributes:
        request_id: the request.
        token_ids: the ``num_scheduled_tokens`` token ids to feed, at positions ``start_pos ..``; when drafts are
            verified they are the last ``len(spec_token_ids)`` of them.
        start_pos: the request's ``num_computed_tokens`` when scheduled (position of ``token_ids[0]``).
        block_ids: the request's whole block table after allocation (covers ``start_pos + len(token_ids)``).
        spec_token_ids: draft tokens verified this step (the last token + these: ``k + 1`` target distributions).
        spec_draft_probs: ``[len(spec_token_ids), V]`` float32, the distributions the drafts were sampled from
            (draft-model proposer, sampled requests), or ``None`` (deterministic drafts: ``q`` one-hot).
        samples: this step computes the request's last known token, so a next token is sampled.
        sampling_states: when ``samples``: the request's ``SamplingState``, then one per forked sample of an
            ``n > 1`` request whose prompt completes now (they all draw from the prompt's last logits); else ``[]``.
        grammar_bitmask: ``[R, ceil(V/32)]`` int32 token masks of the rows sampled this step (structured outputs:
            one per entry of ``sampling_states``, or ``k + 1`` when verifying ``k`` drafts, row ``j`` the grammar's
            state after drafts ``0 .. j-1``); ``None`` when the request has no grammar or does not sample.
        prompt_logprobs: top logprobs per scored prompt position (``SamplingParams.prompt_logprobs``), when this
            step scores prompt positions; else ``None``.
        prompt_logprob_start: index in ``token_ids`` of the first scored row.
        prompt_logprob_targets: the next prompt token of each scored row (rows ``prompt_logprob_start ..
            + len(prompt_logprob_targets)``); its logprob and the top ``prompt_logprobs`` are returned for each.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Optional[torch.Tensor] = None
    samples: bool = False
    sampling_states: list[SamplingState] = field(default_factory=list)
    grammar_bitmask: Optional[torch.Tensor] = None
    prompt_logprobs: Optional[int] = None
    prompt_logprob_start: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed this step, ``>= 1``."""
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What to run this step.

    Attributes:
        scheduled: running requests first (decodes before prompt chunks), then newly admitted ones.
        preempted: request ids preempted this step (their blocks are already free).
        block_copies: copy-on-write ``(src_block_id, dst_block_id)`` pairs, to copy before this step's writes.
        kv_loads: ``(block_id, payload)`` pairs: block contents read from the disk tier (bytes-like, the layout of
            the model runner's ``copy_block_out``), to copy into the blocks before anything else this step, even
            when nothing is scheduled.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, object]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step.

    Attributes:
        sampled_token_ids: request id -> the tokens it gets this step: one sampled token, or, after verifying
            ``k`` drafts, the accepted drafts + the recovered or bonus token (``1 .. k + 1`` tokens). Forked
            samples of an ``n > 1`` request have their own entries. Requests that do not sample are absent.
        num_accepted: request id -> drafts accepted, for each request that verified drafts.
        logprobs: request id -> ``{token_id: logprob}`` of its sampled token (+ top alternatives), for requests
            that asked for logprobs.
        prompt_logprobs: request id -> one ``{token_id: logprob}`` per scored prompt row (the row's next prompt
            token + the top ``prompt_logprobs``), in position order, for entries with ``prompt_logprob_targets``.
        prompt_logprob_ranks: request id -> the rank of each scored row's prompt token (1 = most likely), in the
            same order.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprob_ranks: dict[str, list[int]] = field(default_factory=dict)
