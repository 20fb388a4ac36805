"""Turns a ``SchedulerOutput`` into one flat batch, runs the model over the paged cache, and samples.

Flat batch of T tokens over B requests (request b owns rows ``query_start_loc[b]:query_start_loc[b+1]``):
``input_ids [T]``, ``positions [T]``, ``slot_mapping [T]``, ``block_tables`` (B lists), ``seq_lens [B]``,
``query_start_loc [B+1]``, and ``logits_indices [S]`` for the S requests whose last known token is computed now.
"""

from __future__ import annotations

import torch

from kvserve.core.scheduler import ModelRunnerOutput, SchedulerOutput
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaModel
from kvserve.sample.sampler import Sampler


class ModelRunner:
    """Holds the model, the KV cache tensor and the sampler.

    Args:
        model: the forward.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        sampler: the ``Sampler``.

    The cache is one zero-initialised tensor ``[layers, 2, num_blocks, block_size, H_kv, D]`` in the model dtype
    (zeros, not garbage: masked-out keys are multiplied by 0 in attention, and 0 * NaN would be NaN).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, sampler: Sampler,
                 rejection_sampler=None):
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.rejection_sampler = rejection_sampler
        self.kv_cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=model.dtype)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled token (and logprobs) of every request that samples this step."""
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_start_loc, seq_lens, block_tables = [0], [], []
        logits_indices, sampling_requests, verifying = [], [], []
        for s in scheduler_output.scheduled:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_scheduled_tokens
            end = start + n
            input_ids.extend(_token_slice(req, start, end - len(s.spec_token_ids)) + s.spec_token_ids)
            positions.extend(range(start, end))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            block_tables.append(table)
            if s.samples and s.spec_token_ids:  # the last token + k drafts: k + 1 target distributions
                verifying.append((s, len(logits_indices)))
                logits_indices.extend(range(query_start_loc[-1] - 1 - len(s.spec_token_ids), query_start_loc[-1]))
            elif s.samples:
                for r in [req] + req.fork_children:  # n > 1: every sample draws from the prompt's last logits
                    logits_indices.append(query_start_loc[-1] - 1)
                    sampling_requests.append(r)

        for src, dst in scheduler_output.block_copies:  # copy-on-write, before this step writes into dst
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta = AttentionMetadata.build(query_start_loc, seq_lens, block_tables, slot_mapping, bs)
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_cache,
            meta,
            torch.tensor(logits_indices, dtype=torch.long),
        )
        out = ModelRunnerOutput()
        if sampling_requests:
            rows = logits
            if verifying:  # the rows of plain sampling requests, without the verification spans
                rows = logits[torch.tensor([i for i in range(len(logits_indices)) if not _in_spans(i, verifying)])]
            tokens, logprobs = self.sampler(rows, sampling_requests)
            for req, tok, lp in zip(sampling_requests, tokens, logprobs):
                out.sampled_token_ids[req.request_id] = tok
                if lp is not None:
                    out.logprobs[req.request_id] = lp
        if verifying:
            self._verify(logits, verifying, out)
        return out

    def _verify(self, logits: torch.Tensor, verifying: list, out: ModelRunnerOutput) -> None:
        """Speculative verification: target distributions of every draft position (processed exactly like normal
        sampling) -> the rejection sampler -> accepted drafts + recovered/bonus token per request.

        Draft distributions: when any row carries ``spec_draft_probs`` (a draft model's ``q``), a ``[B, k, V]``
        ``draft_probs`` is built, one-hot on the drafted token for rows without one (deterministic drafts, or
        greedy rows, which ignore ``q``); otherwise ``draft_probs=None``."""
        k_max = max(len(s.spec_token_ids) for s, _ in verifying)
        b, v = len(verifying), logits.shape[1]
        target = torch.zeros(b, k_max + 1, v)
        drafts = torch.full((b, k_max), -1, dtype=torch.long)
        with_q = any(s.spec_draft_probs is not None for s, _ in verifying)
        draft_probs = torch.zeros(b, k_max, v) if with_q else None
        for i, (s, row) in enumerate(verifying):
            k = len(s.spec_token_ids)
            target[i, : k + 1] = self.sampler.target_probs(logits[row : row + k + 1], s.request)
            drafts[i, :k] = torch.tensor(s.spec_token_ids)
            if with_q and s.spec_draft_probs is not None:
                draft_probs[i, :k] = s.spec_draft_probs[:k]
            elif with_q:
                draft_probs[i, torch.arange(k), drafts[i, :k]] = 1.0
        reqs = [s.request for s, _ in verifying]
        tokens = self.rejection_sampler(
            drafts, [len(s.spec_token_ids) for s, _ in verifying], draft_probs, target,
            [r.sampling_params.greedy for r in reqs], [r.generator for r in reqs],
        )
        for r, row in zip(reqs, tokens.tolist()):
            out.verified_token_ids[r.request_id] = [t for t in row if t >= 0]


def _in_spans(i: int, verifying: list) -> bool:
    return any(row <= i <= row + len(s.spec_token_ids) for s, row in verifying)


def _token_slice(req, start: int, end: int) -> list:
    """Tokens ``[start, end)`` of prompt + output without concatenating the whole sequence."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p : end - p]
    return req.prompt_token_ids[start:end] + req.output_token_ids[: max(0, end - p)]
