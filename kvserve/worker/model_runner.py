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
from kvserve.structured.backend import apply_bitmask, stack_bitmasks
from kvserve.batch import StepBuffers, build_step_batch
from kvserve.worker.kv_pool import new_kv_pool
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
    (int8: ``D + 2``, each row's scale after its values, ``kv_layout``), zeros (not garbage: masked-out keys are
    multiplied by 0 in attention, and 0 * NaN would be NaN), allocated lazily (``kv_pool.new_kv_pool``: a page
    counts in RSS only once a block on it is written).
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, sampler: Sampler,
                 rejection_sampler: RejectionSampler | None = None, device: str = "cpu",
                 kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.kv_cache = new_kv_pool(model.kv_cache_shape(num_blocks, block_size), kv_cache_dtype or model.dtype,
                                   device)
        self.step_buffers = StepBuffers()  # the flat batch's tensors, reused step after step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens (and logprobs) of every request that samples this step, and the
        prompt logprobs of the prompt rows the plan marks (``prompt_logprob_targets``). The logits rows are read
        as the batch's ``LogitsLayout`` says; grammar masks come with the plan (``grammar_bitmask``)."""
        out = ModelRunnerOutput()
        for block_id, payload in scheduler_output.kv_loads:  # read from the disk tier: before anything reads them
            self.copy_block_in(block_id, payload)
        entries = scheduler_output.scheduled
        if not entries:
            return out
        for src, dst in scheduler_output.block_copies:  # copy-on-write, before this step writes into dst
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        batch = build_step_batch(entries, self.block_size, self.device, self.step_buffers)
        layout = batch.logits_layout
        logits = self.model.forward(batch, self.kv_cache)
        scoring = [s for s in entries if s.prompt_logprob_targets]
        if scoring:
            out.prompt_logprobs, out.prompt_logprob_ranks = score_prompt_rows(logits[layout.num_sampling_rows:],
                                                                              scoring)
            logits = logits[: layout.num_sampling_rows]
        if layout.sample_rows:
            rows = [r for _, _, r in layout.sample_rows]
            states = [entries[b].sampling_states[j] for b, j, _ in layout.sample_rows]
            masks = stack_bitmasks([None if entries[b].grammar_bitmask is None else entries[b].grammar_bitmask[j]
                                    for b, j, _ in layout.sample_rows])
            sample_logits = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
            tokens, logprobs = self.sampler(sample_logits, states, masks)
            for state, tok, lp in zip(states, tokens, logprobs):
                out.sampled_token_ids[state.request_id] = [tok]
                if lp is not None:
                    out.logprobs[state.request_id] = lp
        if layout.verify_rows:
            self._verify(logits, [(entries[b], row) for b, row in layout.verify_rows], out)
        return out

    def block_slices(self, block_id: int) -> list[torch.Tensor]:
        """Every tensor slice that holds block ``block_id``'s contents, in a fixed order (views): K and V of every
        layer, ``kv_cache[:, :, block_id]`` (``[layers, 2, block_size, H_kv, D]``). A cache with more tensors per
        block (e.g. quantization scales) adds its slices here, and the disk tier follows."""
        return [self.kv_cache[:, :, block_id]]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's ``copy_block_out`` payload."""
        return sum(t.numel() * t.element_size() for t in self.block_slices(0))

    def copy_block_out(self, block_id: int) -> list:
        """A private copy of block ``block_id``'s contents: one contiguous ``uint8`` numpy array per
        ``block_slices`` entry (bytes-like, safe to hand to another thread while the block is reused)."""
        return [t.clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(-1).numpy()
                for t in self.block_slices(block_id)]

    def copy_block_in(self, block_id: int, payload) -> None:
        """Copy ``payload`` (bytes-like, ``block_nbytes`` bytes: a ``copy_block_out`` concatenated) into block
        ``block_id``.

        Raises:
            ValueError: ``payload`` has another size.
        """
        raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        if raw.numel() != self.block_nbytes:
            raise ValueError(f"a block payload must be {self.block_nbytes} bytes, got {raw.numel()}")
        offset = 0
        for t in self.block_slices(block_id):
            n = t.numel() * t.element_size()
            t.copy_(raw[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[ScheduledRequest, int]],
                out: ModelRunnerOutput) -> None:
        """Speculative verification: target distributions of every draft position (processed exactly like normal
        sampling, under the plan's grammar masks) -> the rejection sampler -> accepted drafts + recovered/bonus
        token per request.

        A draft the grammar refuses has target probability 0, so it is rejected and the recovered token is drawn
        from the masked distribution. Draft distributions: when any row carries ``spec_draft_probs`` (a draft
        model's ``q``), a ``[B, k, V]`` ``draft_probs`` is built, one-hot on the drafted token for rows without one
        (deterministic drafts, or greedy rows, which ignore ``q``); otherwise ``draft_probs=None``."""
        k_max = max(len(s.spec_token_ids) for s, _ in verifying)
        b, v = len(verifying), logits.shape[1]
        target = torch.zeros(b, k_max + 1, v, device=logits.device)
        drafts = torch.full((b, k_max), -1, dtype=torch.long)
        with_q = any(s.spec_draft_probs is not None for s, _ in verifying)
        draft_probs = torch.zeros(b, k_max, v, device=logits.device) if with_q else None
        states = [s.sampling_states[0] for s, _ in verifying]
        for i, (s, row) in enumerate(verifying):
            k = len(s.spec_token_ids)
            rows = logits[row : row + k + 1]
            if s.grammar_bitmask is not None:
                rows = rows.float().clone()
                apply_bitmask(rows, s.grammar_bitmask)
            target[i, : k + 1] = self.sampler.target_probs(rows, states[i])
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
