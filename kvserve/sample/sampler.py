"""Batched sampling from next-token logits, with per-request parameters and generators.

Order of operations, as in vLLM: raw logprobs (for ``logprobs``) -> ``allowed_token_ids``, ``bad_words``,
``logit_bias`` and the thinking budget (``kvserve.sample.logits_edits``) -> min_tokens suppression of stop tokens ->
grammar masks (structured outputs: one ``[B, ceil(V/32)]`` bitmask from the plan, a row per request with a
grammar) ->
repetition / presence / frequency penalties -> greedy rows take the argmax; sampled rows: temperature -> top-k ->
top-p (nucleus, Holtzman et al. 2020) -> min-p -> one draw per row.

The filtered distribution is built over each row's most likely candidates, without sorting the vocabulary, and the
draw is by inverse transform (``kvserve.sample.nucleus``): each sampled row takes one uniform from its own
``torch.Generator`` (seeded requests) or the sampler's, so a seeded request's tokens do not depend on what else is in
the batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.sample.state import SamplingState
from kvserve.sample import nucleus
from kvserve.sample.argmax import argmax
from kvserve.sample.logits_edits import apply_logits_edits
from kvserve.structured.backend import apply_bitmask


class Sampler:
    """Samples one token per row.

    Args:
        eos_token_ids: tokens suppressed before ``min_tokens`` (unless ``ignore_eos``).
        generator: the generator used by unseeded requests.
    """

    def __init__(self, eos_token_ids=(), generator: Optional[torch.Generator] = None):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, states: list[SamplingState],
                 grammar_masks: Optional[tuple[torch.Tensor, list[int]]] = None) -> tuple[list[int], list]:
        """Sample a token for each row.

        Args:
            logits: ``[B, V]`` float32, row b belongs to ``states[b]``.
            states: ``B`` ``SamplingState`` views (params, token history, generator).
            grammar_masks: structured outputs: ``([B, ceil(V/32)] int32 bitmask, rows that have a grammar)``
                (``kvserve.structured.backend.stack_bitmasks`` of the plan's masks), or ``None``.

        Returns:
            ``(token_ids, logprobs)``: ``token_ids`` a list of B ints; ``logprobs`` a list of B entries, each
            ``None`` or a dict ``{token_id: logprob}`` with the sampled token and the top ``logprobs`` tokens
            (log-softmax of the raw logits).
        """
        b, v = logits.shape
        params = [r.params for r in states]
        # Greedy fast path: no full-vocabulary softmax for a row that did not ask for logprobs, and no copy of the
        # logits unless a row's stop tokens, grammar or penalties edit them.
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        raw = logits
        if grammar_masks is not None or any(len(r.output_token_ids) < r.params.min_tokens or _has_penalty(r.params)
                                            or r.params.edits_logits for r in states):
            logits = logits.clone()
            edited = [i for i, r in enumerate(states) if r.params.edits_logits]
            if edited:
                rows = logits[edited]
                apply_logits_edits(rows, [states[i] for i in edited])
                logits[edited] = rows
            self._suppress_stop_tokens(logits, states)
            if grammar_masks is not None:
                self._apply_grammar_masks(logits, raw, *grammar_masks)
            self._apply_penalties(logits, states)

        rows = [i for i, p in enumerate(params) if not p.greedy]
        # the greedy pick, unless every row samples (it would be overwritten: a [b, V] read, 0.25 ms warm at b = 64)
        tokens = argmax(logits) if len(rows) < b else torch.empty(b, dtype=torch.long)
        if rows:
            idx = torch.tensor(rows)
            uniforms = torch.cat([torch.rand(1, generator=states[i].generator or self.generator, dtype=torch.float64)
                                  for i in rows])
            rows_logits = logits if len(rows) == b else logits[idx]
            tokens[idx] = nucleus.sample(rows_logits, [params[i] for i in rows], uniforms)

        token_list = tokens.tolist()
        logprobs = [None] * b
        for j, i in enumerate(lp_rows):
            entry = {}
            if params[i].logprobs > 0:
                top = raw_logprobs[j].topk(params[i].logprobs)
                entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[token_list[i]] = float(raw_logprobs[j, token_list[i]])
            logprobs[i] = entry
        return token_list, logprobs

    @torch.inference_mode()
    def target_probs(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        """The distributions a request samples from, for ``[n, V]`` logits rows (speculative verification):
        temperature, top-k, top-p and min-p applied as in ``__call__``; for greedy requests ``softmax(logits)``,
        whose argmax is the greedy token. Returns ``[n, V]`` float32."""
        sp = state.params
        if sp.greedy:
            return logits.float().softmax(dim=-1)
        return nucleus.probabilities(logits.float(), [sp] * logits.shape[0])

    def _suppress_stop_tokens(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        for i, r in enumerate(states):
            sp = r.params
            if len(r.output_token_ids) < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    @staticmethod
    def _apply_grammar_masks(logits: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Structured outputs: disallowed tokens -> -inf in ``rows``. Where ``min_tokens`` suppressed every token
        the grammar allows (its text can only end now), the grammar wins: the row is ``raw`` under the grammar mask
        alone."""
        apply_bitmask(logits, bitmask, rows)
        for i in [i for i in rows if not torch.isfinite(logits[i]).any()]:
            logits[i] = raw[i]
            apply_bitmask(logits[i : i + 1], bitmask[i : i + 1])

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
        for i, r in enumerate(states):
            sp = r.params
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _has_penalty(sp) -> bool:
    return sp.repetition_penalty != 1.0 or bool(sp.presence_penalty) or bool(sp.frequency_penalty)
