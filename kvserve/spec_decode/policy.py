"""One adaptive speculation policy: the draft length ``k``, the gate (draft only while it pays) and the back-off,
driven by one acceptance estimate per request.

Cost model of one engine step with ``b`` requests decoding and ``D`` draft tokens in all: ``t = F + m (b + D)``,
``F`` the fixed cost of a step (weights read, per-op overhead) and ``m`` the cost of one more token in it. It emits
``b + A`` tokens (``A`` accepted drafts); without drafts, ``b`` tokens in ``F + m b``. Verifying is faster iff
``A / D > c b / (1 + c b)`` with ``c = m / F``: on a memory-bound step ``c`` is about 0 and every draft is worth
trying, on a nearly compute-bound CPU step it is not (``c`` measured for this project's CPU in
docs/performance.md, "When a draft pays"). A proposer with a model adds its own cost per draft token (its share of
a target pass, ``Proposer.cost``), so the break-even acceptance is ``cost + c b / (1 + c b)`` (Leviathan et al.
2023, §3.4, makes the same argument for choosing ``k``).

Per request (``SpecState``): ``acceptance``, an exponential moving average of accepted / drafted tokens, starting
at 0.5; ``k``, grown by one after a fully accepted draft, else cut to what was accepted (at least 1). While the
estimate is at or below the break-even rate of the current batch size the request backs off:

- a free proposer (n-gram) still drafts, but the draft is held back and compared with the tokens the request
  actually gets next (a "shadow" check): the matched prefix is distributed exactly like the number of drafts the
  rejection sampler would have accepted (for a one-hot draft, token i is accepted with probability ``p(d_i)``, the
  chance that sampling produces ``d_i``), so the estimate keeps learning for free and drafting resumes when the
  text starts to repeat;
- a proposer with a model drafts only on steps that are a multiple of ``pause``: each failed probe multiplies the
  pause by 4 (up to ``max_pause``), each passed one divides it by 4; a failed probe resets the estimate to the
  break-even rate, so one passed probe resumes drafting. Probes are aligned on a step counter shared by all
  requests, so backing-off requests probe together and share one draft pass and one verification step; a new
  request starts at the median pause of the live ones, or of the last 8 to finish.

The policy is deterministic (no timings), so a seeded request's output is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: ``c = m / F`` of the step cost model; docs/performance.md, "When a draft pays", gives the measurement.
VERIFY_COST_PER_TOKEN = 0.1
#: Weight of one observation in the moving average.
EMA_WEIGHT = 0.2
#: A new request's acceptance estimate.
INITIAL_ACCEPTANCE = 0.5


def break_even_acceptance(batch_size: int, verify_cost_per_token: float = VERIFY_COST_PER_TOKEN,
                          draft_cost: float = 0.0) -> float:
    """The acceptance rate (accepted / drafted tokens, 0..1) above which drafting speeds up a step of
    ``batch_size`` decoding requests: ``draft_cost + c b / (1 + c b)``, at most 1.

    Raises:
        ValueError: ``batch_size`` < 1 or a negative cost.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if verify_cost_per_token < 0 or draft_cost < 0:
        raise ValueError(f"costs must be >= 0, got {verify_cost_per_token}, {draft_cost}")
    cb = verify_cost_per_token * batch_size
    return min(1.0, draft_cost + cb / (1 + cb))


@dataclass
class SpecState:
    """One request's speculation state.

    Attributes:
        k: its current draft length, ``[1, max_k]``.
        acceptance: moving average of accepted / drafted tokens, 0..1.
        pause: draft only on steps that are a multiple of this (proposers with a model); a power of 4.
        shadow: ``(output index, draft ids)`` of a held-back draft awaiting its shadow check, or ``None``.
    """

    k: int
    acceptance: float = INITIAL_ACCEPTANCE
    pause: int = 1
    shadow: Optional[tuple[int, list[int]]] = None


class SpecPolicy:
    """The per-request draft length, gate and back-off (see the module docstring).

    Args:
        max_k: ``num_speculative_tokens``.
        initial_k: a new request's ``k``.
        free: the proposer costs nothing (shadow checks instead of pauses).
        draft_cost: a draft token's cost over a target token's, 0..1.
        verify_cost_per_token: ``c`` of the cost model.
        max_pause: the longest back-off, in steps; a power of 4.

    Raises:
        ValueError: ``max_pause`` not a power of 4.
    """

    def __init__(self, max_k: int, initial_k: int, free: bool, draft_cost: float = 0.0,
                 verify_cost_per_token: float = VERIFY_COST_PER_TOKEN, max_pause: int = 64):
        if max_pause < 1 or max_pause & (max_pause - 1) or max_pause.bit_length() % 2 == 0:
            raise ValueError(f"max_pause must be a power of 4 >= 1, got {max_pause}")
        self.max_k = max_k
        self.initial_k = min(initial_k, max_k)
        self.free = free
        self.draft_cost = draft_cost
        self.verify_cost_per_token = verify_cost_per_token
        self.max_pause = max_pause
        self.recent_pauses: list[int] = []  # the pauses of the last 8 requests released
        self.num_held_back = 0  # drafts proposed but not verified because they would not pay

    def new_state(self, live: list[SpecState]) -> SpecState:
        """A new request's state: ``initial_k``; the median pause of ``live`` states, or of the last 8 released."""
        pauses = sorted(s.pause for s in live) or sorted(self.recent_pauses) or [1]
        return SpecState(k=self.initial_k, pause=pauses[len(pauses) // 2])

    def release(self, state: SpecState) -> None:
        """A request left: remember its pause for the next newcomers."""
        self.recent_pauses = (self.recent_pauses + [state.pause])[-8:]

    def break_even(self, batch_size: int) -> float:
        return break_even_acceptance(batch_size, self.verify_cost_per_token, self.draft_cost)

    def budget(self, state: SpecState, step: int) -> int:
        """How many tokens to ask the proposer for at ``step`` (0: not this step)."""
        if self.free or step % state.pause == 0:
            return state.k
        return 0

    def admit(self, state: SpecState, draft: list[int], num_output_tokens: int, batch_size: int) -> list[int]:
        """The part of a fresh ``draft`` to verify next step: all of it, or ``[]`` when a free proposer's request
        is backing off (the draft is then kept for a shadow check at output index ``num_output_tokens``)."""
        if not draft or not self.free or state.acceptance > self.break_even(batch_size):
            return draft
        if state.shadow is None:  # one shadow check at a time
            state.shadow = (num_output_tokens, list(draft))
        self.num_held_back += 1
        return []

    def observe_verified(self, state: SpecState, num_drafted: int, num_accepted: int, batch_size: int) -> None:
        """Fold a verification (``num_accepted`` of ``num_drafted``) into the estimate, ``k`` and the pause."""
        if not num_drafted:
            return
        self._observe(state, num_accepted / num_drafted)
        if num_accepted == num_drafted:
            state.k = min(self.max_k, state.k + 1)
        else:
            state.k = max(1, min(state.k, num_accepted + 1) - (num_accepted == 0))
        if not self.free:
            threshold = self.break_even(batch_size)
            if state.acceptance <= threshold:
                state.pause = min(4 * state.pause, self.max_pause)
                state.acceptance = threshold  # one passed probe is then enough to resume
            else:
                state.pause = max(1, state.pause // 4)

    def observe_shadow(self, state: SpecState, output_token_ids: list[int]) -> None:
        """Once the tokens a held-back draft predicted have been generated (or one came out different), fold
        ``matched prefix / drafted`` into the estimate and clear the shadow."""
        if state.shadow is None:
            return
        index, draft = state.shadow
        actual = output_token_ids[index : index + len(draft)]
        matched = 0
        while matched < len(actual) and actual[matched] == draft[matched]:
            matched += 1
        if matched < len(actual) or len(actual) == len(draft):  # a miss, or the whole draft came true
            self._observe(state, matched / len(draft))
            state.shadow = None

    @staticmethod
    def _observe(state: SpecState, rate: float) -> None:
        state.acceptance += EMA_WEIGHT * (rate - state.acceptance)
