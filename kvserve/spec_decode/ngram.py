"""N-gram (prompt lookup) proposer: draft by copying what followed an earlier occurrence of the context's tail.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding): in summarisation, RAG, code
editing and similar tasks the output repeats spans of the input, so the tokens that followed the last few tokens
the last time they appeared are a good, free guess. The draft is deterministic, so the rejection sampler treats
its ``q`` as one-hot.
"""

from __future__ import annotations

import numpy as np

from kvserve.spec_decode.proposer import DraftProposal, Proposer, check_budgets


class NgramProposer(Proposer):
    """Proposes the continuation of the most recent earlier match of the longest matching suffix.

    For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: if the last ``n`` tokens also occur
    earlier (an occurrence may overlap the suffix but not be it), take the most recent such occurrence and
    propose the up to ``max_num_tokens`` tokens that followed it (fewer when the sequence ends first). The first
    (longest) ``n`` with a match wins; ``[]`` if none matches.

    Free (``Proposer.free``): held-back drafts are checked in shadow. Cost: one vectorised pass over the history
    per call, ``O(prompt_lookup_max * len(token_ids))`` numpy work, most of it converting the list.

    Args:
        prompt_lookup_min: shortest suffix tried, >= 1.
        prompt_lookup_max: longest suffix tried, >= ``prompt_lookup_min``.

    Raises:
        ValueError: an argument is out of range (the message names it and the range).
    """

    free = True

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, num_speculative_tokens: int = 4):
        if not isinstance(prompt_lookup_min, int) or prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be an integer >= 1, got {prompt_lookup_min!r}")
        if not isinstance(prompt_lookup_max, int) or prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be an integer >= prompt_lookup_min ({prompt_lookup_min}), "
                f"got {prompt_lookup_max!r}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.initial_k = num_speculative_tokens  # free to draft: start at the longest draft

    def propose(self, requests: list, max_num_tokens: list[int]) -> list[DraftProposal]:
        """``lookup`` for each request's prompt + output tokens (see ``Proposer.propose``)."""
        check_budgets(requests, max_num_tokens)
        return [DraftProposal(self.lookup(r.all_token_ids, k) if k else []) for r, k in zip(requests, max_num_tokens)]

    def lookup(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Draft up to ``max_num_tokens`` tokens (see the class docstring for the rule).

        Args:
            token_ids: prompt + output token ids so far.
            max_num_tokens: the most tokens to propose, >= 0.

        Returns:
            A list of at most ``max_num_tokens`` ints, a contiguous slice of ``token_ids``; ``[]`` when no suffix
            of length in ``[prompt_lookup_min, prompt_lookup_max]`` occurs earlier.

        Raises:
            ValueError: ``max_num_tokens`` is negative.
        """
        if max_num_tokens < 0:
            raise ValueError(f"max_num_tokens must be >= 0, got {max_num_tokens}")
        length = len(token_ids)
        longest = min(self.prompt_lookup_max, length - 1)  # an earlier occurrence ends before the last token
        if max_num_tokens == 0 or longest < self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # match_len[e]: how many tokens ending at e (e < length - 1) equal the same-length suffix, capped at
        # `longest`; built one offset at a time, a candidate dropping out at its first mismatch.
        num_ends = length - 1
        still = np.ones(num_ends, dtype=bool)
        match_len = np.zeros(num_ends, dtype=np.int64)
        for j in range(longest):
            # ends e >= j can compare token e - j with token length - 1 - j
            still[:j] = False
            still[j:] &= tokens[: num_ends - j] == tokens[length - 1 - j]
            match_len += still
        for n in range(longest, self.prompt_lookup_min - 1, -1):
            ends = np.flatnonzero(match_len >= n)
            if ends.size:
                start = int(ends[-1]) + 1
                return tokens[start : start + max_num_tokens].tolist()
        return []
