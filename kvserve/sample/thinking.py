"""The thinking budget (``SamplingParams.thinking_token_budget``, vLLM's name): a sampler stage that ends a
request's reasoning after a number of tokens by forcing the end-of-reasoning tokens, one by one, each the only token
its row allows. The answer then follows as the model continues.

Each sample keeps its own ``ThinkingBudget`` in its ``SamplingState`` (made when the request is added); it reads
the sample's output tokens (``sync``: only the new ones, or all again if the list got shorter) so it needs no
other channel. The mask depends only on the row's own tokens: the stage is batch invariant.
"""

from __future__ import annotations

from typing import Optional

import torch


class ThinkingBudget:
    """One sample's progress through its reasoning.

    Phases: ``"before"`` (reasoning not open: waiting for ``start_ids`` at the end of the output), ``"thinking"``
    (counting reasoning tokens; at ``budget`` the ``end_ids`` are forced one by one), ``"done"`` (the output ended
    with ``end_ids``, naturally or forced; nothing more is forced).

    Args:
        budget: reasoning tokens allowed, ``>= 0`` (0: the end marker comes first).
        start_ids, end_ids: token ids of the start and end markers (``tokenizer.encode(marker)`` without special
            tokens: a special ``</think>`` token is one id; a text marker such as Granite's several).
        open_at_start: the prompt opened the reasoning (a chat template that writes ``<think>`` into the prompt):
            the output starts in ``"thinking"``.

    Attributes:
        count: reasoning tokens so far (the tokens after the start marker, before the end marker's).
        forced: how many of ``end_ids`` have been forced.
    """

    def __init__(self, budget: int, start_ids: list[int], end_ids: list[int], open_at_start: bool):
        self.budget, self.start_ids, self.end_ids = budget, list(start_ids), list(end_ids)
        self.open_at_start = open_at_start
        self._reset()

    def _reset(self) -> None:
        self.phase = "thinking" if self.open_at_start else "before"
        self.count = 0
        self.forced = 0
        self.num_seen = 0

    def sync(self, output_token_ids: list[int]) -> None:
        """Take the output tokens not seen yet (start over when the list got shorter: a rollback)."""
        if len(output_token_ids) < self.num_seen:
            self._reset()
        for i in range(self.num_seen, len(output_token_ids)):
            self._take(output_token_ids, i)
        self.num_seen = len(output_token_ids)

    def _take(self, out: list[int], i: int) -> None:
        if self.phase == "before":
            if _ends_with(out, i + 1, self.start_ids):
                self.phase = "thinking"
        elif self.phase == "thinking":
            if self.forced or self.count >= self.budget:
                self.forced += 1
                if self.forced == len(self.end_ids):
                    self.phase = "done"
            else:
                self.count += 1
                if _ends_with(out, i + 1, self.end_ids):
                    self.phase = "done"

    def forced_token(self) -> Optional[int]:
        """The token the next sample must be, or ``None`` (not forcing)."""
        if self.phase == "thinking" and (self.forced or self.count >= self.budget):
            return self.end_ids[self.forced]
        return None


def _ends_with(out: list[int], n: int, seq: list[int]) -> bool:
    """``out[:n]`` ends with ``seq``."""
    return n >= len(seq) and out[n - len(seq):n] == seq


def force_thinking_end(logits: torch.Tensor, states: list) -> None:
    """Rows whose reasoning is over budget allow only their forced token (every other logit ``-inf``; the forced
    one keeps its value, so logprobs of the processed row stay finite). In place.

    Args:
        logits: ``[B, V]`` float32, row b of ``states[b]`` (a ``SamplingState``).
        states: the rows' sampling states; rows without a ``thinking`` budget are untouched.
    """
    for i, st in enumerate(states):
        tb = st.thinking
        if tb is None:
            continue
        tb.sync(st.output_token_ids)
        t = tb.forced_token()
        if t is not None:
            value = logits[i, t].clone()
            logits[i] = float("-inf")
            logits[i, t] = value if torch.isfinite(value) else 0.0
