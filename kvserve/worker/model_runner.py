"""Runs one step plan: plan -> flat batch (``input_batch``) -> forward over the paged cache -> samplers.

The runner owns the device, the KV cache tensor, the model and the samplers. It reads only the
``SchedulerOutput`` (never a live ``Request``) and returns one ``ModelRunnerOutput``.
"""

from __future__ import annotations

import torch

from kvserve.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.model.base import CausalLM
from kvserve.sample.rejection_sampler import RejectionSampler
from kvserve.sample.sampler import Sampler
from kvserve.structured.backend import apply_bitmask
from kvserve.batch import StepBuffers, build_step_batch
from kvserve.worker.kv_pool import lazy_zeros
from kvserve.worker.prompt_logprobs import score_prompt_rows


class ModelRunner:
    """Holds the model, the KV cache tensor and the samplers.

    Args:
        model: the forward (``CausalLM``).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        sampler: the ``Sampler``.
        rejection_sampler: verifies drafts (speculative decoding); a default one is made when ``None``.
        device: where the cache and the step's tensors live.
        kv_cache_dtype: the cache's element type (the engine's, from ``CacheConfig.resolve_kv_cache_dtype``);
            ``None``: the model's dtype.

    The cache is one zero-initialised tensor ``[layers, 2, num_blocks, block_size, H_kv, D]`` in ``kv_cache_dtype``
    (zeros, not garbage: masked-out keys are multiplied by 0 in attention, and 0 * NaN would be NaN), allocated
    lazily (``kv_pool.lazy_zeros``: a page counts in RSS only once a block on it is written).
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, sampler: Sampler,
                 rejection_sampler: RejectionSampler | None = None, device: str = "cpu",
                 kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.kv_cache = lazy_zeros(model.kv_cache_shape(num_blocks, block_size), kv_cache_dtype or model.dtype,
                                   device)
        self.step_buffers = StepBuffers()  # the flat batch's tensors, reused step after step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens (and logprobs) of every request that samples this step, and the
        prompt logprobs of the prompt rows the plan marks (``prompt_logprob_targets``)."""
        out = ModelRunnerOutput()
        if not scheduler_output.scheduled:
            return out
        for src, dst in scheduler_output.block_copies:  # copy-on-write, before this step writes into dst
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        batch, num_sampling_rows = build_step_batch(scheduler_output.scheduled, self.block_size, self.device,
                                                    self.step_buffers)
        logits = self.model.forward(batch, self.kv_cache)
        scoring = [s for s in scheduler_output.scheduled if s.prompt_logprob_targets]
        if scoring:
            out.prompt_logprobs, out.prompt_logprob_ranks = score_prompt_rows(logits[num_sampling_rows:], scoring)
            logits = logits[:num_sampling_rows]

        # logits rows follow batch.logits_indices: per sampling entry, one row per sample, or k + 1 when verifying
        plain_rows, plain_states, verifying, row = [], [], [], 0
        for s in scheduler_output.scheduled:
            if not s.samples:
                continue
            if s.spec_token_ids:
                verifying.append((s, row))
                row += len(s.spec_token_ids) + 1
            else:
                for state in s.sampling_states:
                    plain_rows.append(row)
                    plain_states.append(state)
                    row += 1
        if plain_states:
            rows = logits if len(plain_rows) == logits.shape[0] else logits[torch.tensor(plain_rows)]
            tokens, logprobs = self.sampler(rows, plain_states)
            for state, tok, lp in zip(plain_states, tokens, logprobs):
                out.sampled_token_ids[state.request_id] = [tok]
                if lp is not None:
                    out.logprobs[state.request_id] = lp
        if verifying:
            self._verify(logits, verifying, out)
        return out

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[ScheduledRequest, int]],
                out: ModelRunnerOutput) -> None:
        """Speculative verification: target distributions of every draft position (processed exactly like normal
        sampling) -> the rejection sampler -> accepted drafts + recovered/bonus token per request.

        Draft distributions: when any row carries ``spec_draft_probs`` (a draft model's ``q``), a ``[B, k, V]``
        ``draft_probs`` is built, one-hot on the drafted token for rows without one (deterministic drafts, or
        greedy rows, which ignore ``q``); otherwise ``draft_probs=None``."""
        k_max = max(len(s.spec_token_ids) for s, _ in verifying)
        b, v = len(verifying), logits.shape[1]
        target = torch.zeros(b, k_max + 1, v, device=logits.device)
        drafts = torch.full((b, k_max), -1, dtype=torch.long)
        with_q = any(s.spec_draft_probs is not None for s, _ in verifying)
        draft_probs = torch.zeros(b, k_max, v, device=logits.device) if with_q else None
        states = [s.sampling_states[0] for s, _ in verifying]
        for i, (s, row) in enumerate(verifying):
            k = len(s.spec_token_ids)
            target[i, : k + 1] = self.sampler.target_probs(
                self._grammar_masked(logits[row : row + k + 1], states[i], s.spec_token_ids), states[i])
            drafts[i, :k] = torch.tensor(s.spec_token_ids)
            if with_q and s.spec_draft_probs is not None:
                draft_probs[i, :k] = s.spec_draft_probs[:k]
            elif with_q:
                draft_probs[i, torch.arange(k), drafts[i, :k]] = 1.0
        tokens = self.rejection_sampler(
            drafts, [len(s.spec_token_ids) for s, _ in verifying], draft_probs, target,
            [st.params.greedy for st in states], [st.generator for st in states],
        )
        for (s, _), row in zip(verifying, tokens.tolist()):
            emitted = [t for t in row if t >= 0]
            out.sampled_token_ids[s.request_id] = emitted
            out.num_accepted[s.request_id] = len(emitted) - 1

    @staticmethod
    def _grammar_masked(rows: torch.Tensor, state, drafts: list[int]) -> torch.Tensor:
        """Structured outputs under speculation: the ``[k + 1, V]`` logits of a request's draft positions, row
        ``j`` masked by its grammar advanced through drafts ``0 .. j-1`` (then rolled back: the scheduler advances
        it through the tokens actually kept). A draft the grammar refuses has target probability 0, so it is
        rejected and the recovered token is drawn from the masked distribution. Rows of requests without a
        grammar are returned as they are."""
        if state.grammar is None:
            return rows
        bitmask = torch.empty((rows.shape[0], (rows.shape[1] + 31) // 32), dtype=torch.int32)
        state.grammar.sync(state.output_token_ids)
        state.grammar.fill_drafts(bitmask, drafts)
        rows = rows.float().clone()
        apply_bitmask(rows, bitmask)
        return rows
