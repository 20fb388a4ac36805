"""``Speculator``: speculative decoding behind one object the engine calls once per step.

After each step it (1) folds the step's verification outcomes (``ModelRunnerOutput.num_accepted``) into the
policy and the counters, then (2) asks the proposer for drafts for every eligible running request in one call,
and (3) returns what the policy admits, which the engine hands to ``Scheduler.update_draft_token_ids`` for the
next step. The scheduler only rolls back rejected drafts; it knows nothing of the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.spec_decode.policy import SpecPolicy, SpecState
from kvserve.spec_decode.proposer import Proposer


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters.

    Attributes:
        max_k: the configured ``num_speculative_tokens``.
        num_drafts: verification passes with at least one draft token.
        num_draft_tokens, num_accepted_tokens: draft tokens verified / accepted.
        accepted_per_position: ``[max_k]``, how often the draft at position i (0-based) was accepted.
    """

    max_k: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_k

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens, 0..1."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass: accepted drafts + the recovered or bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def may_speculate(req: Request) -> bool:
    """Whether a running request's next tokens may be drafted: not with logprobs, penalties or a pending
    ``min_tokens`` (its next-token distribution then depends on the tokens before it in ways the verifier does
    not model)."""
    sp = req.sampling_params
    return (req.status is RequestStatus.RUNNING and sp.logprobs is None
            and len(req.output_token_ids) >= sp.min_tokens and sp.repetition_penalty == 1.0
            and not sp.presence_penalty and not sp.frequency_penalty)


class Speculator:
    """A proposer and the policy that decides how much of its work to verify.

    Args:
        proposer: the ``Proposer`` (n-gram or draft model).
        policy: the ``SpecPolicy``.

    Attributes:
        stats: ``SpecDecodeStats`` (reset by the engine's ``reset_stats``).
        states: request id -> ``SpecState`` of live requests.
    """

    def __init__(self, proposer: Proposer, policy: SpecPolicy):
        self.proposer = proposer
        self.policy = policy
        self.stats = SpecDecodeStats(policy.max_k)
        self.states: dict[str, SpecState] = {}
        self.num_steps = 0  # the shared step counter the back-off's probes align on

    def step(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput, updated: list[Request],
             running: list[Request]) -> dict[str, tuple[list[int], Optional[torch.Tensor]]]:
        """Observe this step's verifications, then draft for the next one.

        Args:
            scheduler_output, model_output: the step just run.
            updated: requests that received tokens this step (finished ones included).
            running: the scheduler's running requests after the step (their count is the batch size).

        Returns:
            request id -> ``(admitted draft token ids, their distributions [k, V] float32 or None)`` for every
            request drafted for (an empty list: none admitted), for ``Scheduler.update_draft_token_ids``.
        """
        self.num_steps += 1
        batch_size = max(1, len(running))
        for s in scheduler_output.scheduled:
            if s.spec_token_ids and s.request_id in self.states:
                accepted = model_output.num_accepted[s.request_id]
                self.stats.record(len(s.spec_token_ids), accepted)
                self.policy.observe_verified(self.states[s.request_id], len(s.spec_token_ids), accepted, batch_size)
        eligible, budgets, states = [], [], []
        for req in updated:
            if req.status.finished:
                self._drop(req.request_id)
                continue
            if not may_speculate(req):
                continue
            state = self.states.get(req.request_id)
            if state is None:
                state = self.states[req.request_id] = self.policy.new_state(list(self.states.values()))
            self.policy.observe_shadow(state, req.output_token_ids)
            room = min(req.sampling_params.max_tokens - len(req.output_token_ids), req.max_total_tokens - req.num_tokens)
            eligible.append(req)
            budgets.append(max(0, min(self.policy.budget(state, self.num_steps), room - 1)))
            states.append(state)
        drafts = {}
        if eligible:
            for req, state, proposal in zip(eligible, states, self.proposer.propose(eligible, budgets)):
                admitted = self.policy.admit(state, proposal.token_ids, len(req.output_token_ids), batch_size)
                drafts[req.request_id] = (admitted, proposal.probs if admitted else None)
        self.proposer.release_all_but(r.request_id for r in running)
        return drafts

    def abort(self, request_ids: Iterable[str], running: list[Request]) -> None:
        """Forget aborted requests and free the proposer's state of everything no longer running."""
        for rid in request_ids:
            self._drop(rid)
        self.proposer.release_all_but(r.request_id for r in running)

    def _drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.policy.release(state)
