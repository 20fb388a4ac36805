"""Speculative sampling: verify drafted tokens against the target model without changing its distribution.

Terms, used with these meanings throughout ``kvserve.spec_decode`` and here:

- **draft tokens**: the ``k`` (or fewer) tokens a cheap *proposer* guessed would come next, drawn from the
  proposer's distribution ``q`` (a small draft model), or picked deterministically (n-gram lookup), in which case
  ``q`` is one-hot on the picked token.
- **target distribution** ``p``: what the model being served (the *verifier*) would sample from at each
  position, computed for all draft positions in one forward pass over ``1 + k`` tokens, after the request's
  temperature / top-k / top-p processing. Position ``j`` has its own ``p_j``; position ``k`` (one past the last
  draft) is there for the bonus token.
- **accepted tokens**: the drafts kept, a prefix of the draft. Draft ``j`` is kept with probability
  ``min(1, p_j(t) / q_j(t))``; the first one refused ends the prefix, and nothing after it is looked at.
- **recovered token**: emitted in place of the first refused draft, sampled from the residual distribution
  ``normalize(max(0, p_j - q_j))``. Acceptance plus recovery emit a token distributed exactly as ``p_j``
  (Leviathan, Kalman, Matias, ICML 2023, Alg. 1 and Theorem 3.5; Chen et al. 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling").
- **bonus token**: when every draft was accepted, one more token sampled from the target distribution of the
  position after the last draft, which the verification pass computed anyway.

So one verification step emits between 1 and ``k + 1`` tokens per request. Greedy requests use the limit of the
rule: a draft is accepted iff it equals the target argmax, and the recovered or bonus token is that argmax, so
greedy output with speculation is token-for-token the output without it.

Randomness: each row draws only from its own generator (or from the sampler's shared one when it has none), in a
fixed amount that depends on nothing else in the batch: ``num_draft_tokens[b]`` uniforms for the acceptance
tests, then one more for the recovered or bonus token (an inverse-transform draw, ``kvserve.sample.nucleus.draw``,
as in ``kvserve.sample.sampler``; a vocabulary of exponentials per row cost ~1.1 ms on the CPU). A seeded request
therefore gets the same tokens whatever else is in the batch and whatever the batch's padded draft length ``k``.
Greedy rows draw nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from kvserve.sample import nucleus
from kvserve.sample.argmax import argmax

PAD_TOKEN_ID = -1
"""Fills draft slots a row does not use and output slots after a row's last emitted token."""


class RejectionSampler:
    """Batched speculative-sampling verifier (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    Args:
        generator: the generator used by rows whose entry in ``generators`` is ``None``; default: a CPU
            generator seeded with 0.
    """

    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def __call__(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int],
        draft_probs: Optional[torch.Tensor],
        target_probs: torch.Tensor,
        greedy: Union[Sequence[bool], torch.Tensor],
        generators: Sequence[Optional[torch.Generator]],
    ) -> torch.Tensor:
        """Verify each row's drafts and emit its accepted tokens plus one recovered or bonus token.

        Args:
            draft_token_ids: ``[B, k]`` int64; row b's drafts in ``[:, :num_draft_tokens[b]]``, the rest -1.
            num_draft_tokens: ``B`` ints in ``[0, k]``.
            draft_probs: ``[B, k, V]`` float, the proposer's distribution ``q`` at each draft position; ``None``
                for proposers without a distribution (``q`` one-hot on the drafted token).
            target_probs: ``[B, k + 1, V]`` float, the target distributions ``p`` to sample from (temperature,
                top-k, top-p already applied; rows sum to 1). Row j is for draft j's position, row
                ``num_draft_tokens[b]`` for the bonus token; rows past that are ignored.
            greedy: ``B`` bools (list or bool tensor); greedy rows accept iff draft == argmax of the target row
                and emit argmaxes.
            generators: ``B`` entries, a ``torch.Generator`` for a seeded row or ``None`` (the sampler's own).

        Returns:
            ``[B, k + 1]`` int64 on ``target_probs.device``: row b holds its accepted drafts, then the
            recovered or bonus token, then -1 padding. Row b emits ``accepted + 1`` tokens, at least 1.

        Raises:
            ValueError: inconsistent shapes or lengths, ``num_draft_tokens`` outside ``[0, k]``, or a used draft
                id outside ``[0, V)``.
        """
        b, k, v = self._check(draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy, generators)
        device = target_probs.device
        greedy_t = torch.as_tensor(greedy, dtype=torch.bool).reshape(b).to(device)
        n = torch.tensor(list(num_draft_tokens), dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)
        valid = torch.arange(k, device=device)[None, :] < n[:, None]  # [B, k]
        drafts = torch.where(valid, draft_token_ids.to(device), 0)  # pads -> a harmless index

        uniforms, final_u = self._draw(b, k, v, num_draft_tokens, greedy_t.tolist(), generators, device)

        # -- acceptance of each draft position, then the accepted prefix
        target_at_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).float()  # p_j(t_j)
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.to(device).gather(-1, drafts[..., None]).squeeze(-1).float()  # q_j(t_j)
        accept = self._accept(target_at_draft, draft_at_draft, uniforms)
        accept_greedy = drafts == argmax(target_probs[:, :k])
        accept = torch.where(greedy_t[:, None], accept_greedy, accept) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B], index of the first refusal (or n)

        # -- the one recovered or bonus token per row
        dist = target_probs[rows, num_accepted].float()  # [B, V]: p at the final position
        rejected = (num_accepted < n) & ~greedy_t
        if k > 0 and bool(rejected.any()):
            at = num_accepted.clamp_max(k - 1)
            q = None if draft_probs is None else draft_probs.to(device)[rows, at].float()
            residual = self._recovery_distribution(dist, q, drafts[rows, at])
            dist = torch.where(rejected[:, None], residual, dist)
        sampled = nucleus.draw(None, dist, final_u)  # inverse transform: dist need not be normalised
        final = torch.where(greedy_t, argmax(dist), sampled)

        out = torch.full((b, k + 1), PAD_TOKEN_ID, dtype=torch.long, device=device)
        keep = torch.arange(k, device=device)[None, :] < num_accepted[:, None]
        out[:, :k] = torch.where(keep, drafts, PAD_TOKEN_ID)
        out[rows, num_accepted] = final
        return out

    @staticmethod
    def _accept(target_p: torch.Tensor, draft_q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """The acceptance test of Alg. 1: accept with probability ``min(1, p / q)``.

        Args:
            target_p: ``[B, k]`` float32, ``p_j(t_j)`` of each drafted token.
            draft_q: ``[B, k]`` float32, ``q_j(t_j)``.
            uniforms: ``[B, k]`` float32 in ``[0, 1)``.

        Returns:
            ``[B, k]`` bool. Written as ``u * q < p`` so that ``q == 0`` needs no division: such a draft
            (impossible under ``q``, but a proposer may still send it) is accepted iff ``p > 0``, and a token
            with ``p == 0`` is never accepted.
        """
        return uniforms * draft_q < target_p

    @staticmethod
    def _recovery_distribution(
        target: torch.Tensor, draft: Optional[torch.Tensor], draft_token: torch.Tensor
    ) -> torch.Tensor:
        """``normalize(max(0, p - q))`` per row, or ``p`` where that residual is all zero.

        Args:
            target: ``[B, V]`` float32, ``p`` at the refused position.
            draft: ``[B, V]`` float32 ``q`` there, or ``None`` for one-hot ``q`` on ``draft_token``.
            draft_token: ``[B]`` int64, the refused draft.

        Returns:
            ``[B, V]`` float32, not normalised (the inverse-transform draw does not need it). The residual is all zero
            only when ``p <= q`` everywhere, i.e. ``p == q``, where a refusal has probability 0 and happens only
            through rounding; sampling from ``p`` is then the right answer.
        """
        if draft is None:  # max(0, p - onehot(t)) is p with t removed
            residual = target.scatter(1, draft_token[:, None], 0.0)
        else:
            residual = (target - draft).clamp_min(0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        return torch.where(empty, target, residual)

    def _draw(self, b, k, v, num_draft_tokens, greedy, generators, device):
        """Uniforms ``[B, k]`` (float32) for the acceptance tests and ``[B]`` (float64) for the final token's
        inverse-transform draw, each row from its own generator.

        A seeded row draws ``num_draft_tokens[b]`` uniforms, then one; unseeded rows draw together from
        ``self.generator``; greedy rows draw nothing (their entries are 0).
        """
        uniforms = torch.zeros(b, k)
        final = torch.zeros(b, dtype=torch.float64)
        shared = [i for i in range(b) if not greedy[i] and generators[i] is None]
        if shared:
            idx = torch.tensor(shared)
            uniforms[idx] = torch.rand(len(shared), k, generator=self.generator)
            final[idx] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for i in range(b):
            g = generators[i]
            if greedy[i] or g is None:
                continue
            n = num_draft_tokens[i]
            uniforms[i, :n] = torch.rand(n, generator=g, device=g.device).cpu()
            final[i] = torch.rand(1, generator=g, device=g.device, dtype=torch.float64).cpu()[0]
        return uniforms.to(device), final.to(device)

    @staticmethod
    def _check(draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy, generators):
        if draft_token_ids.dim() != 2:
            raise ValueError(f"draft_token_ids must be [B, k], got shape {tuple(draft_token_ids.shape)}")
        b, k = draft_token_ids.shape
        if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1):
            raise ValueError(
                f"target_probs must be [B, k + 1, V] = [{b}, {k + 1}, V], got shape {tuple(target_probs.shape)}"
            )
        v = target_probs.shape[2]
        if draft_probs is not None and tuple(draft_probs.shape) != (b, k, v):
            raise ValueError(f"draft_probs must be [B, k, V] = [{b}, {k}, {v}], got shape {tuple(draft_probs.shape)}")
        for name, seq in (("num_draft_tokens", num_draft_tokens), ("greedy", greedy), ("generators", generators)):
            if len(seq) != b:
                raise ValueError(f"{name} must have one entry per row (B = {b}), got {len(seq)}")
        bad = [n for n in num_draft_tokens if not 0 <= n <= k]
        if bad:
            raise ValueError(f"num_draft_tokens must be in [0, k] = [0, {k}], got {bad[0]}")
        n = torch.tensor(list(num_draft_tokens), device=draft_token_ids.device)
        used = draft_token_ids[torch.arange(k, device=draft_token_ids.device)[None, :] < n[:, None]]
        bad_ids = used[(used < 0) | (used >= v)]
        if bad_ids.numel():
            raise ValueError(f"draft token ids must be in [0, V) = [0, {v}) where used, got {int(bad_ids[0])}")
        return b, k, v


def accepted_lengths(output: torch.Tensor) -> list:
    """Accepted draft tokens per row of a ``RejectionSampler`` output.

    Args:
        output: ``[B, k + 1]`` int64, -1 padded, as returned by ``RejectionSampler.__call__``.

    Returns:
        ``B`` ints in ``[0, k]``: the number of emitted tokens minus the one recovered or bonus token.
    """
    return ((output != PAD_TOKEN_ID).sum(dim=1) - 1).tolist()
