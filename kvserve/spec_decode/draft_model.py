"""Draft-model proposer: a smaller model with the target's vocabulary drafts ``k`` tokens autoregressively.

Speculative sampling (Leviathan, Kalman, Matias, ICML 2023; Chen et al. 2023): the draft model proposes
``d_1..d_k`` sampled from its own (processed) distributions ``q_1..q_k``; the target scores them in one pass and
``RejectionSampler`` keeps each with probability ``min(1, p/q)``, so the output follows the target exactly. Greedy
requests draft the draft model's argmax and keep a draft iff it is the target's argmax.

The draft model is either a separate model (``speculative_config["model"]``: a GGUF file or HF directory with the
target's vocabulary) or, by default, a *self-speculative early-exit* view of the target: its first
``draft_num_layers`` layers, then the target's final norm and (tied) LM head, sharing the target's weight tensors
(Zhang et al. 2023, "Draft & Verify: Lossless LLM Acceleration via Self-Speculative Decoding"; Elhoushi et al.
2024, "LayerSkip"). Measured on SmolLM2-135M-Instruct, which was not trained for early exit (LayerSkip trains
with layer dropout and an early-exit loss for exactly this reason), the early exit agrees poorly with the full
model; see ``kvserve.config.DEFAULT_DRAFT_NUM_LAYERS`` and docs/design.md, "Speculative decoding", for the numbers.

The draft model has its own paged KV cache (``[L, 2, num_blocks, block_size, H_kv, D]``) and its own block pool
and per-request block tables (a ``KVCacheManager`` without prefix caching). Per request it remembers how many of
the request's tokens have draft K/V (``num_computed_tokens`` of its ``_DraftSeq``); a call feeds the missing
tokens as one flat batch over all drafting requests (the first call is the prompt's prefill), samples ``d_1``, then
runs ``k - 1`` batched one-token steps. After verification with ``a`` drafts accepted, the draft K/V is valid up
to ``old_len + min(a, k - 1)`` tokens; the next call finds that by comparing the tokens it fed with the request's
actual tokens, so it needs no hook into the scheduler's rollback.

Back-off: a draft pass costs a sizeable fraction of a target pass (for an early exit, ``L`` layers plus the whole
LM head, which for SmolLM2 is 28M of its 134M multiply-adds per token), so a request whose drafts are rarely
accepted would run slower than with no speculation at all. ``cost`` (``relative_cost``) feeds the speculation
policy's break-even rate; ``kvserve.spec_decode.policy`` decides when a request drafts (its pause) and how many
tokens it asks for.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.core.kv_cache_manager import KVCacheManager, blocks_needed
from kvserve.core.sched_output import ScheduledRequest
from kvserve.model.fused_layers import FusedLayerLoop
from kvserve.model.decoder import DecoderModel
from kvserve.sample import nucleus
from kvserve.sample.argmax import argmax
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.proposer import DraftProposal, Proposer, check_budgets
from kvserve.batch import build_input_batch
from kvserve.worker.kv_pool import new_kv_pool


def early_exit_model(target: DecoderModel, num_layers: int) -> DecoderModel:
    """A view of ``target`` that runs only its first ``num_layers`` layers, then its final norm and LM head.

    Shares every weight tensor with ``target`` (nothing is copied); ``kv_cache_shape`` / ``bytes_per_block``
    count ``num_layers`` layers.

    Raises:
        ValueError: ``num_layers`` outside ``[1, target layers - 1]`` (the message names
            ``speculative_config.draft_num_layers`` and the range).
    """
    n = target.arch.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < n:
        raise ValueError(
            f"speculative_config.draft_num_layers must be in [1, {n - 1}] (the target has {n} layers), "
            f"got {num_layers!r}"
        )
    view = copy.copy(target)
    view.layers = target.layers[:num_layers]
    per_layer = {f: getattr(target.arch, f)[:num_layers] for f in ("layer_types", "no_rope_layers")
                 if getattr(target.arch, f, None) is not None}  # (windows, SmolLM3's NoPE layers: the first ones)
    view.arch = dataclasses.replace(target.arch, num_hidden_layers=num_layers, **per_layer)
    view.spec = target.spec.first(num_layers)
    view.fused_layers = FusedLayerLoop.build(view)  # the target's would run all its layers on the draft's cache
    return view


def relative_cost(draft: DecoderModel, target: DecoderModel) -> float:
    """Multiply-adds per token of ``draft`` over those of ``target`` (layers + LM head; attention over the
    context and the embedding lookup are left out), e.g. about 0.32 for a 4-layer early exit of SmolLM2-135M."""

    def macs(m: DecoderModel) -> int:
        w = m.layers[0]  # (a mixture of experts: the router and the top-k experts a token runs)
        per_layer = sum(w[name].numel() for name in ("qkv", "o")) + (
            w["moe"].numel() if w["moe"] is not None else w["gate_up"].numel() + w["down"].numel())
        return per_layer * len(m.layers) + m.lm_head.numel()

    return macs(draft) / macs(target)


@dataclass
class _DraftSeq:
    """A request's state in the draft model's cache; also the ``request`` object the draft ``KVCacheManager``
    allocates for (it reads ``request_id`` and ``num_computed_tokens``).

    Attributes:
        request_id: the request's id.
        num_computed_tokens: leading tokens of the request whose K/V is in the draft cache.
        fed_from: ``len(tokens)`` when the last drafts were made: ``drafts[j]`` sits at position ``fed_from + j``.
        drafts: the last call's drafts (the first ``len - 1`` of them have draft K/V).
    """

    request_id: str
    num_computed_tokens: int = 0
    fed_from: int = 0
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Batched draft-model proposer with its own paged KV cache (see the module docstring).

    Args:
        model: the draft model (``early_exit_model(target, L)`` or a separately loaded ``DecoderModel``).
        num_blocks: blocks in the draft pool. Size it so that every running request can hold its tokens + ``k``:
            e.g. the target pool's blocks + ``max_num_seqs * (ceil((k + 1) / block_size) + 1)``. Should the pool
            still run dry (the target shares prefix-cached blocks, the draft does not), the request that cannot
            get blocks simply does not draft this step and its draft blocks are released.
        block_size: tokens per block.
        sampler: the engine's ``Sampler`` (its ``target_probs`` processes logits exactly as the target's).
        cost: a draft token's multiply-adds over a target token's (``relative_cost``), 0..1.
        max_catch_up_tokens: the most tokens one catch-up pass feeds (a long prompt's draft prefill is split
            into passes of this size, like chunked prefill, so its attention scores stay small); >= 1.
        generator: draws for unseeded sampled requests (seeded ones use their own generator); default a CPU
            generator seeded with 0.
        kv_cache_dtype: the draft pool's element type (the engine passes its ``kv_cache_dtype``); ``None``: the
            model's dtype.
    """

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, sampler: Sampler, cost: float = 0.0,
                 max_catch_up_tokens: int = 512, generator: Optional[torch.Generator] = None,
                 kv_cache_dtype: Optional[torch.dtype] = None):
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        if isinstance(max_catch_up_tokens, bool) or not isinstance(max_catch_up_tokens, int) or max_catch_up_tokens < 1:
            raise ValueError(f"max_catch_up_tokens must be an integer >= 1, got {max_catch_up_tokens!r}")
        self.cost = cost
        self.max_catch_up_tokens = max_catch_up_tokens
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_cache = new_kv_pool(model.kv_cache_shape(num_blocks, block_size), kv_cache_dtype or model.dtype)
        self.seqs: dict[str, _DraftSeq] = {}
        self.num_forward_passes = 0

    # ------------------------------------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, requests: list, max_num_tokens: list[int]) -> list[DraftProposal]:
        """Draft for a batch of running requests at once (``Proposer.propose``). Every request passed in, budget 0
        included, has its draft K/V brought in line with its accepted tokens; a request gets no draft when its
        budget is 0 or the draft pool is exhausted."""
        check_budgets(requests, max_num_tokens)
        out = [DraftProposal([]) for _ in requests]
        active = []  # (index, request, seq, k, tokens)
        for i, (req, k) in enumerate(zip(requests, max_num_tokens)):
            seq = self.seqs.get(req.request_id)
            if seq is None:
                seq = self.seqs[req.request_id] = _DraftSeq(req.request_id)
            tokens = req.all_token_ids
            self._observe(seq, tokens)
            if k == 0:
                continue
            # K/V for positions [num_computed, n) plus k - 1 drafts; the last token is always recomputed
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(tokens) - 1)
            self.kv_cache_manager.trim(seq)
            need = len(tokens) - seq.num_computed_tokens + k - 1
            if self.kv_cache_manager.allocate_slots(seq, need) is None:
                self._release(req.request_id)
                continue
            active.append((i, req, seq, k, tokens))
        if not active:
            return out

        drafts = {i: [] for i, *_ in active}
        probs = {i: [] for i, *_ in active}
        # catch up on the tokens without draft K/V (a prefill the first time) in passes of at most
        # max_catch_up_tokens (bounded attention memory), keeping each request's last token for pass 0
        backlog = [(i, req, seq, tokens[seq.num_computed_tokens : -1]) for i, req, seq, k, tokens in active]
        while 0 < sum(len(b[3]) for b in backlog) > self.max_catch_up_tokens - len(backlog):
            feed, room = [], self.max_catch_up_tokens
            for j, (i, req, seq, rest) in enumerate(backlog):
                take = min(len(rest), room)
                if take:
                    feed.append((i, req, seq, rest[:take]))
                    backlog[j] = (i, req, seq, rest[take:])
                    room -= take
            self._step(feed, drafts, probs, sample=False)
        # pass 0: the rest of the catch-up and the last token, sample d_1
        feed = [(i, req, seq, tokens[seq.num_computed_tokens:]) for i, req, seq, k, tokens in active]
        self._step(feed, drafts, probs)
        for j in range(1, max(k for *_, k, _ in active)):  # pass j: feed d_j, sample d_{j+1}
            feed = [(i, req, seq, [drafts[i][-1]]) for i, req, seq, k, _ in active if k > j]
            self._step(feed, drafts, probs)
        for i, req, seq, k, tokens in active:
            seq.fed_from = len(tokens)
            seq.drafts = drafts[i]
            out[i] = DraftProposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return out

    def _step(self, feed: list, drafts: dict, probs: dict, sample: bool = True) -> None:
        """One flat forward over ``feed`` = ``[(index, request, seq, new token ids)]``: write their K/V, advance each
        ``seq.num_computed_tokens``, and (``sample``) draw one draft token per request from its last row's logits."""
        entries = []
        for _, req, seq, new in feed:
            states = [req.sampling_state] if sample else []
            entries.append(ScheduledRequest(seq.request_id, list(new), seq.num_computed_tokens,
                                            self.kv_cache_manager.get_block_ids(seq), samples=sample,
                                            sampling_states=states))
            seq.num_computed_tokens += len(new)
        logits = self.model.forward(build_input_batch(entries, self.block_size, self.kv_cache.device.type),
                                    self.kv_cache)
        self.num_forward_passes += 1
        if not sample:
            return
        tokens = argmax(logits).tolist()
        for row, (i, req, _, _) in enumerate(feed):
            if not req.sampling_params.greedy:  # sample d ~ q with the request's own generator (inverse transform)
                q = self.sampler.target_probs(logits[row : row + 1], req.sampling_state)[0]
                g = req.generator or self.generator
                u = torch.rand(1, generator=g, device=g.device, dtype=torch.float64).to(q.device)
                tokens[row] = int(nucleus.draw(None, q[None], u)[0])
                probs[i].append(q)
            drafts[i].append(tokens[row])

    def _observe(self, seq: _DraftSeq, tokens: list[int]) -> None:
        """Compare the last drafts with what the request actually produced: keep the draft K/V of the accepted
        ones (positions ``fed_from ..``)."""
        if not seq.drafts:
            return
        n = len(seq.drafts)
        actual = tokens[seq.fed_from : seq.fed_from + n]
        accepted = 0
        while accepted < len(actual) and actual[accepted] == seq.drafts[accepted]:
            accepted += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.fed_from + accepted)
        seq.drafts = []

    # ------------------------------------------------------------------------------------------------ lifetime
    def release_all_but(self, running_ids) -> None:
        """Free the draft blocks and state of every request not in ``running_ids`` (finished, aborted,
        preempted); call once per step with the scheduler's running requests."""
        keep = set(running_ids)
        for rid in [r for r in self.seqs if r not in keep]:
            self._release(rid)

    def _release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv_cache_manager.free(seq)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    def check_integrity(self) -> None:
        """The pool invariants of ``KVCacheManager.check_integrity``, plus: every block table covers its
        request's computed draft tokens."""
        self.kv_cache_manager.check_integrity()
        for rid, seq in self.seqs.items():
            held = len(self.kv_cache_manager.req_to_blocks.get(rid, ()))
            assert held >= blocks_needed(seq.num_computed_tokens, self.block_size), f"{rid}: table too short"


def draft_pool_blocks(target_num_blocks: int, max_num_seqs: int, num_speculative_tokens: int, block_size: int) -> int:
    """Draft pool size: the target's blocks + per running request ``ceil((k + 1) / block_size) + 1`` (the draft
    tokens of a step and a partly filled block), so the draft never runs short where the target does not."""
    return target_num_blocks + max_num_seqs * (blocks_needed(num_speculative_tokens + 1, block_size) + 1)

