"""When a draft pays for itself: the break-even acceptance rate and a per-request gate for free proposers.

Cost model of one engine step with ``b`` requests decoding and ``D`` draft tokens in all: ``t = F + m (b + D)``
seconds, ``F`` the fixed cost of a step (weights read, per-op overhead) and ``m`` the cost of one more token in it.
It emits ``b + A`` tokens (``A`` accepted drafts); without drafts, ``b`` tokens in ``F + m b``. Speculation is
faster iff ``A / D > c b / (1 + c b)`` with ``c = m / F``: on a GPU (or any memory-bound step) ``c`` is about 0 and
every draft is worth trying, but on this project's 2-core CPU a decode step is nearly compute-bound — measured
``F`` ~57 ms and ``m`` ~6 ms (batch-1 step 63 ms, batch-16 step 155 ms), ``c`` ~0.1 — so the break-even
acceptance rises from 0.09 at batch 1 to 0.44 at batch 8 and 0.62 at batch 16. (The same argument, with a
draft pass added to ``F``, is why adaptive speculation lengths matter; see Leviathan et al. 2023, §3.4.)

``SpecGate`` keeps, per request, an exponential moving average of its acceptance rate and lets an n-gram draft
through only while that estimate is above the break-even rate of the current batch size. A draft held back is
not wasted: it is compared with the tokens the request actually gets next (a "shadow" check, free for a proposer
without a model). The length of the matching prefix is distributed exactly like the number of drafts the rejection
sampler would have accepted (for a one-hot draft, token i is accepted with probability ``p(d_i)``, the probability
that sampling produces ``d_i``), so ``matched / drafted`` is an unbiased observation of the same acceptance rate,
the estimate keeps learning, and the request resumes drafting when its text starts to repeat.
The gate is deterministic (no timings), so a seeded request's output is reproducible; it does depend on how many
requests are running, like any batch-size-aware policy.
"""

from __future__ import annotations

# c = m / F measured on the 2-core CPU (see the module docstring); a GPU path would set it near 0.
VERIFY_COST_PER_TOKEN = 0.1
# Weight of one observation in the moving average (a new request starts from ``Request.spec_acceptance`` = 0.5).
EMA_WEIGHT = 0.2


def break_even_acceptance(batch_size: int, verify_cost_per_token: float = VERIFY_COST_PER_TOKEN) -> float:
    """The acceptance rate (accepted / drafted tokens, 0..1) above which drafting speeds up a step of
    ``batch_size`` decoding requests: ``c b / (1 + c b)``.

    Raises:
        ValueError: ``batch_size`` < 1 or a negative cost.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if verify_cost_per_token < 0:
        raise ValueError(f"verify_cost_per_token must be >= 0, got {verify_cost_per_token}")
    cb = verify_cost_per_token * batch_size
    return cb / (1 + cb)


class SpecGate:
    """Per-request acceptance estimates and the draft / hold-back decision for a free (model-less) proposer.

    State lives on the request: ``spec_acceptance`` (the moving average, starts at 0.5) and
    ``spec_shadow`` (``(output index, draft token ids)`` of a held-back draft, or ``None``).
    """

    def __init__(self, verify_cost_per_token: float = VERIFY_COST_PER_TOKEN):
        self.verify_cost_per_token = verify_cost_per_token
        self.num_held_back = 0  # drafts proposed but not verified because they would not pay

    @staticmethod
    def observe_verified(req, num_drafted: int, num_accepted: int) -> None:
        """Fold a verification's outcome (``num_accepted`` of ``num_drafted``) into the request's estimate."""
        if num_drafted:
            req.spec_acceptance += EMA_WEIGHT * (num_accepted / num_drafted - req.spec_acceptance)

    @staticmethod
    def observe_shadow(req) -> None:
        """Once the tokens a held-back draft predicted have been generated (or one of them came out different),
        fold ``matched prefix / drafted`` into the estimate and clear the shadow."""
        if req.spec_shadow is None:
            return
        index, draft = req.spec_shadow
        actual = req.output_token_ids[index : index + len(draft)]
        matched = 0
        while matched < len(actual) and actual[matched] == draft[matched]:
            matched += 1
        if matched < len(actual) or len(actual) == len(draft):  # a miss, or the whole draft came true
            req.spec_acceptance += EMA_WEIGHT * (matched / len(draft) - req.spec_acceptance)
            req.spec_shadow = None

    def admit(self, req, draft: list, batch_size: int) -> list:
        """The draft to verify next step: ``draft`` itself while the request's estimate beats the break-even rate
        of ``batch_size``, else ``[]`` (its first token is kept for a shadow check)."""
        if not draft:
            return []
        if req.spec_acceptance > break_even_acceptance(batch_size, self.verify_cost_per_token):
            return draft
        if req.spec_shadow is None:  # one shadow check at a time
            req.spec_shadow = (len(req.output_token_ids), list(draft))
        self.num_held_back += 1
        return []
