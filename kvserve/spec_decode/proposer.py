"""The interface every proposer (drafter) implements.

A proposer guesses the next few tokens of each request; the target model then scores all of them in one forward
pass and ``RejectionSampler`` keeps the longest acceptable prefix (Leviathan, Kalman, Matias, ICML 2023). The
``Speculator`` calls ``propose`` once per step for all eligible requests, so a proposer with a model drafts for
all of them in one batch of forward passes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass
class DraftProposal:
    """One request's draft.

    Attributes:
        token_ids: the drafted token ids (``n`` ints, ``0 <= n <= k``).
        probs: ``[n, V]`` float32, the distributions ``q`` the drafts were sampled from (after the request's
            temperature / top-k / top-p / min-p), for the rejection sampler; ``None`` for deterministic drafts
            (n-gram) and greedy requests, whose verification needs no ``q``.
    """

    token_ids: list[int]
    probs: Optional[torch.Tensor] = None


class Proposer(abc.ABC):
    """Drafts up to ``k`` tokens to follow each request's token history.

    Attributes:
        free: proposing costs nothing next to a target step (no model): the policy may draft every step and check
            held-back drafts in shadow instead of backing off.
        cost: one draft token's multiply-adds over one target token's, 0..1 (0 for a free proposer): the
            draft's share of the break-even acceptance rate.
        initial_k: the draft length a new request starts with.
    """

    free: bool = False
    cost: float = 0.0
    initial_k: int = 1

    @abc.abstractmethod
    def propose(self, requests: list, max_num_tokens: list[int]) -> list[DraftProposal]:
        """Draft for a batch of running requests at once.

        Args:
            requests: ``B`` running ``Request`` objects that just received their latest token(s) (their prompt +
                output token ids are read).
            max_num_tokens: ``B`` ints >= 0, the most tokens to draft for each (``0``: none this step).

        Returns:
            ``B`` ``DraftProposal`` objects, each with at most its budget of tokens (``[]``: no draft).

        Raises:
            ValueError: ``len(requests) != len(max_num_tokens)`` or a negative budget.
        """

    def release_all_but(self, running_ids: Iterable[str]) -> None:
        """Free any per-request state of requests not in ``running_ids`` (finished, aborted, preempted)."""


def check_budgets(requests: list, max_num_tokens: list[int]) -> None:
    """The argument checks of ``Proposer.propose``."""
    if len(requests) != len(max_num_tokens):
        raise ValueError(f"requests and max_num_tokens differ in length: {len(requests)} vs {len(max_num_tokens)}")
    if any(k < 0 for k in max_num_tokens):
        raise ValueError(f"max_num_tokens must be >= 0, got {min(max_num_tokens)}")
