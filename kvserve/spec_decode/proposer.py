"""The interface every proposer (drafter) implements.

A proposer guesses the next few tokens of a request cheaply; the target model then scores all of them in one
forward pass and ``RejectionSampler`` keeps the longest acceptable prefix (Leviathan, Kalman, Matias, ICML 2023).
"""

from __future__ import annotations

import abc


class Proposer(abc.ABC):
    """Drafts up to ``max_num_tokens`` tokens to follow a request's token history.

    This is the interface of *token-history* proposers (n-gram / prompt lookup), which need nothing but the
    request's prompt + output token ids and draft deterministically (one-hot ``q``: the rejection sampler is
    called with ``draft_probs=None``).

    The draft-model proposer (a smaller model with its own paged KV cache, or an early-exit view of the target)
    cannot run one request at a time efficiently; ``kvserve.spec_decode.draft_model.DraftModelProposer`` is the
    batched variant: ``propose(requests, max_num_tokens)`` takes the step's eligible requests and returns, per
    request, the draft token ids and their ``[n, V]`` draft probabilities ``q`` for the rejection sampler.
    """

    @abc.abstractmethod
    def propose(self, token_ids: list, max_num_tokens: int) -> list:
        """Draft the tokens that should follow ``token_ids``.

        Args:
            token_ids: the request's prompt + output token ids so far (ints).
            max_num_tokens: the most tokens to draft (>= 0), e.g. ``num_speculative_tokens`` capped by what
                is left before ``max_tokens`` / ``max_model_len``.

        Returns:
            Between 0 and ``max_num_tokens`` token ids; ``[]`` means "no draft this step".

        Raises:
            ValueError: ``max_num_tokens`` is negative.
        """
