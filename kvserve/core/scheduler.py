"""Iteration-level scheduler (Orca, Yu et al., OSDI 2022) over the paged KV cache, with preemption by recompute.

There are no prefill and decode phases. Each request has ``num_computed_tokens``; each step the scheduler gives
it ``num_scheduled_tokens`` more to compute: its whole prompt when admitted, 1 per decode step, prompt + output
again after a preemption. ``schedule()`` returns a plain ``SchedulerOutput``; the model's sampled tokens come back
through ``update_from_output()``, so the scheduler is testable with a fake model runner.

Policies: ``"continuous"`` admits waiting requests every step while ``max_num_seqs``, the token budget
(``max_num_batched_tokens``) and free blocks allow; ``"static"`` admits a batch only when nothing is running and
runs it until it drains (the baseline that continuous batching beats). With chunked prefill, a prompt longer
than what is left of the step's budget is split across steps; the chunk [s, s+q) attends to exactly s+q keys.
Queue order is FCFS, or ``(priority, arrival)`` under ``scheduling_policy="priority"``.

With the prefix cache's disk tier (``kv_tier``), a request whose next blocks after its pool hits are on disk is
not admitted at once: it takes blocks for them and waits, in ``RequestStatus.WAITING_FOR_KV_LOAD`` (vLLM's
``WAITING_FOR_REMOTE_KVS``), while a worker thread reads them; the others are scheduled meanwhile. When the read
is done the plan carries the bytes (``SchedulerOutput.kv_loads``, copied into the blocks before the step runs),
the blocks enter the prefix cache and are freed, and the request goes back to the front of the queue, where its
admission finds them as ordinary pool hits.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.config import SchedulerConfig
from kvserve.core.block_pool import BlockHash, KVCacheBlock
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_disk_tier import KVDiskTier, LoadResult
from kvserve.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.structured.backend import plan_bitmask

logger = logging.getLogger(__name__)


def _priority_key(req: Request) -> tuple:
    """Lower ``priority`` value first; ties in arrival order."""
    return (req.priority, req.queue_seq)


#: With nothing else to do, ``schedule`` waits at most this long (seconds) for a disk-tier load to finish.
KV_LOAD_POLL_SECONDS = 0.05


@dataclass
class _KVLoad:
    """A request waiting for its blocks from the disk tier: ``blocks[i]`` receives ``hashes[i]``'s entry; a request
    waiting on another request's load of the same blocks has none of its own (``blocks == []``)."""

    request: Request
    hashes: list[BlockHash]
    blocks: list[KVCacheBlock]
    future: Future
    start: float


def _plan_prompt_logprobs(req: Request, plan: ScheduledRequest) -> None:
    """Mark the rows of ``plan`` whose next prompt token is still to be scored (``prompt_logprobs``).

    Row ``j`` (position ``p``) scores prompt token ``p + 1``: positions ``[len(req.prompt_logprobs) - 1,
    num_prompt_tokens - 1)`` are still missing. Positions already scored (before a preemption by recompute) are not
    scored again, so entries are never duplicated.
    """
    k = req.sampling_params.prompt_logprobs
    first = max(plan.start_pos, len(req.prompt_logprobs) - 1)
    last = min(plan.start_pos + plan.num_scheduled_tokens - len(plan.spec_token_ids), req.num_prompt_tokens - 1)
    if k is None or first >= last:
        return
    assert first == len(req.prompt_logprobs) - 1, "prompt positions must be scored in order"
    plan.prompt_logprobs = k
    plan.prompt_logprob_start = first - plan.start_pos
    plan.prompt_logprob_targets = req.prompt_token_ids[first + 1 : last + 1]


class Scheduler:
    """Owns the waiting queue and the running list; allocates KV slots through ``KVCacheManager``.

    Args:
        config: limits and policy.
        kv_cache_manager: the block tables and pool.
        eos_token_ids: the model's end tokens: each ends a request unless ``ignore_eos``.
        eos_token_id: the primary one among them (the tokenizer's EOS): it ends a request with ``stop_reason``
            ``None``; the others set ``stop_reason`` to the token, as vLLM's (merged into its ``stop_token_ids``).
        kv_tier: the prefix cache's disk tier, or ``None`` (module docstring).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, eos_token_ids: tuple = (),
                 eos_token_id: Optional[int] = None, kv_tier: Optional[KVDiskTier] = None):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token_id = eos_token_id
        self.waiting: list[Request] = []
        self._seq = itertools.count()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: request id -> ``(draft token ids, their draft distributions [k, V] or None)`` to verify next step
        #: (``update_draft_token_ids``); taken by ``schedule``.
        self._drafts: dict[str, tuple[list[int], Optional[torch.Tensor]]] = {}
        self.kv_tier = kv_tier
        self._kv_loads: dict[str, _KVLoad] = {}  # request id -> its pending load (WAITING_FOR_KV_LOAD)
        self._kv_looked_up: set[str] = set()  # requests whose disk lookup was done since they were queued

    # ------------------------------------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        """Queue a validated request (FCFS, or by ``(priority, arrival)`` under the priority policy)."""
        request.queue_seq = next(self._seq)
        self.requests[request.request_id] = request
        for child in request.fork_children:  # registered (for aborts); they start at the fork
            self.requests[child.request_id] = child
        self._enqueue(request, preempted=False)

    def _enqueue(self, req: Request, preempted: bool) -> None:
        if self.config.scheduling_policy == "priority":
            bisect.insort(self.waiting, req, key=_priority_key)
        elif preempted:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._kv_loads)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or waiting for their blocks from the disk tier."""
        return len(self.waiting) + len(self._kv_loads)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def loading_requests(self) -> list[Request]:
        """The requests waiting for their blocks from the disk tier (``WAITING_FOR_KV_LOAD``), oldest first."""
        return sorted((j.request for j in self._kv_loads.values()), key=lambda r: r.queue_seq)

    def update_draft_token_ids(self, drafts: dict[str, tuple[list[int], Optional[torch.Tensor]]]) -> None:
        """Drafts to verify in the next step (speculative decoding; vLLM's ``update_draft_token_ids``): request id
        -> ``(draft token ids, their distributions q [k, V] float32 or None for deterministic drafts)``. Drafts of
        a request that is not running when the next step is planned, or that has not caught up with its tokens
        then, are dropped; an empty list clears a request's drafts."""
        for rid, (token_ids, probs) in drafts.items():
            if token_ids:
                self._drafts[rid] = (list(token_ids), probs)
            else:
                self._drafts.pop(rid, None)

    # ------------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work under the token budget ``max_num_batched_tokens``.

        1. Running requests first, decodes before unfinished prefills (so a long prompt being prefilled never
           delays a running request's next token). Each gets its uncomputed tokens (1 when decoding); with
           chunked prefill a prompt takes what is left of the budget and continues next step (SARATHI, Agrawal et
           al. 2023). If a slot cannot be allocated, a victim is preempted — the newest running request (fcfs) or
           the lowest-priority one (priority; ties: the newest) — its blocks freed, ``num_computed_tokens`` reset
           to 0, and requeued (front of the queue under fcfs); allocation is then retried. A victim already
           scheduled this step is unscheduled and its tokens go back to the budget.
        2. If nothing was preempted, waiting requests are admitted in queue order while ``max_num_seqs``, the
           budget and the free blocks allow. The first one that does not fit stops admission (no overtaking).
           Static policy: only when nothing is running, and then a whole batch of up to ``max_num_seqs``
           requests whose prompts' blocks fit (the token budget only paces their prefill over the next steps),
           which then runs until its last request finishes.
        """
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}
        if self._kv_loads:
            self._finish_kv_loads(out, wait=not self.running and not self.waiting)

        # decodes first, then unfinished prefills, each in running order (a stable partition)
        decodes, prefills = [], []
        for req in self.running:
            uncomputed = req.num_uncomputed_tokens
            (decodes if uncomputed <= 1 else prefills).append((req, uncomputed))
        for req, uncomputed in decodes + prefills:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop (a running request's count is unchanged)
            n = self._num_new_tokens(uncomputed, budget)
            drafts, draft_probs = self._drafts.pop(req.request_id, ([], None))
            if n == 0:
                continue
            if drafts and n == uncomputed:  # caught up: verify the drafts in the same pass
                drafts = drafts[: budget - n]
                n += len(drafts)
            elif drafts:
                drafts = []
            if draft_probs is not None:  # q rows stay aligned with the (possibly truncated) drafts
                draft_probs = draft_probs[: len(drafts)] if drafts else None
            new_blocks = kv.allocate_slots(req, n)
            while new_blocks is None:
                victim = self._pick_victim()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_scheduled_tokens
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, n)
            if new_blocks is None:
                continue
            scheduled[req.request_id] = self._plan(req, n, drafts, draft_probs)
            budget -= n
        out.scheduled = list(scheduled.values())

        may_admit = not out.preempted and (self.config.scheduling == "continuous" or not self.running)
        while may_admit and self.waiting:
            req = self.waiting[0]
            if len(self.running) + 1 + len(req.fork_children) > self.config.max_num_seqs:
                break  # (a parallel-sampling request needs a slot for each of its samples)
            hits = kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
                # cached blocks carry no logits: positions still to be scored are computed (and may share blocks)
                hits = hits[: (len(req.prompt_logprobs) - 1) // kv.block_size]
            elif self.kv_tier is not None and self._start_kv_load(req, hits):
                self.waiting.pop(0)  # (waits for its blocks from disk; the next requests go on)
                continue
            uncomputed = req.num_tokens - len(hits) * kv.block_size
            n = self._num_new_tokens(uncomputed, budget)
            if self.config.scheduling == "static":
                # A static batch is formed whole: its prompts' blocks are taken now, their prefill (chunks) runs
                # as the budget allows in this and the next steps.
                if kv.allocate_slots(req, uncomputed, hits) is None:
                    break
            elif n == 0 or kv.allocate_slots(req, n, hits) is None:
                break
            req.num_computed_tokens = len(hits) * kv.block_size
            self.waiting.pop(0)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if n:
                out.scheduled.append(self._plan(req, n))
                budget -= n
        out.block_copies = kv.take_pending_copies()
        return out

    def _plan(self, req: Request, n: int, drafts: Optional[list[int]] = None, draft_probs=None) -> ScheduledRequest:
        """The self-contained plan entry of ``req`` computing ``n`` tokens (the last ``len(drafts)`` are drafts)."""
        start = req.num_computed_tokens
        end = start + n
        if drafts:
            samples = end == req.num_tokens + len(drafts)
            token_ids = req.token_slice(start, end - len(drafts)) + drafts
        else:
            drafts = []
            samples = end == req.num_tokens
            token_ids = req.token_slice(start, end)
        samples_of = ([req] + req.fork_children) if samples else []
        plan = ScheduledRequest(req.request_id, token_ids, start, self.kv_cache_manager.get_block_ids(req), drafts,
                                draft_probs, samples, [r.sampling_state for r in samples_of])
        if samples and req.grammar is not None:  # structured outputs: the masks of the rows sampled this step
            plan.grammar_bitmask = plan_bitmask([r.grammar for r in samples_of],
                                                [r.output_token_ids for r in samples_of], drafts)
        _plan_prompt_logprobs(req, plan)
        return plan

    def _num_new_tokens(self, n: int, budget: int) -> int:
        """Of ``n`` uncomputed tokens, how many to compute now: all, or (chunked prefill) as many as the budget
        allows; 0 if the request cannot be scheduled this step."""
        if self.config.enable_chunked_prefill:
            return min(n, budget)
        return n if n <= budget else 0

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    # ------------------------------------------------------------------------------------------------ disk tier
    def _start_kv_load(self, req: Request, hits: list[KVCacheBlock]) -> bool:
        """If the disk tier holds ``req``'s next blocks after its pool ``hits`` (up to the last prompt token's
        block, which is always computed), start loading them and park ``req`` (``WAITING_FOR_KV_LOAD``); True if
        parked. Looked up once per stay in the queue; a request whose first missing block another request is
        loading waits for that load instead of reading the same entries."""
        rid = req.request_id
        if rid in self._kv_looked_up:
            return False
        kv = self.kv_cache_manager
        hashes = kv.block_hashes(req)[len(hits) : (req.num_tokens - 1) // kv.block_size]
        if not hashes:
            return False
        for other in self._kv_loads.values():
            if other.blocks and hashes[0] in other.hashes:
                self._park(req, _KVLoad(req, [], [], other.future, time.monotonic()))
                return True
        n = self.kv_tier.num_present(hashes)
        blocks = kv.reserve_for_load(req, hits, n) if n else None
        if n and blocks is None:  # the pool is short now: looked up again at the next admission
            return False
        self._kv_looked_up.add(rid)
        self.kv_tier.stats.lookups += len(hashes)
        if not n:
            return False
        self._park(req, _KVLoad(req, hashes[:n], blocks, self.kv_tier.load(hashes[:n]), time.monotonic()))
        return True

    def _park(self, req: Request, load: _KVLoad) -> None:
        req.status = RequestStatus.WAITING_FOR_KV_LOAD
        self._kv_loads[req.request_id] = load

    def _finish_kv_loads(self, out: SchedulerOutput, wait: bool) -> None:
        """Take the finished loads (waiting up to ``KV_LOAD_POLL_SECONDS`` for one when ``wait``): each good block's
        bytes go into the plan (``kv_loads``, copied before this step runs) and the block enters the prefix cache;
        a block after the first bad or missing entry is not used (recomputed). The request's table is freed and
        it goes back to the front of the queue."""
        if wait:
            wait_futures({j.future for j in self._kv_loads.values()}, KV_LOAD_POLL_SECONDS, FIRST_COMPLETED)
        done = [j for j in self._kv_loads.values() if j.future.done()]
        kv = self.kv_cache_manager
        now = time.monotonic()
        for job in sorted(done, key=lambda j: (j.blocks == [], j.request.queue_seq)):  # owners first
            req = job.request
            del self._kv_loads[req.request_id]
            if job.blocks:
                try:
                    result = job.future.result()
                except Exception:  # noqa: BLE001 (a failed read is a miss: the blocks are recomputed)
                    logger.exception("KV disk tier: loading the blocks of request %s failed", req.request_id)
                    result = LoadResult([], 0.0)
                for block, h, payload in zip(job.blocks, job.hashes, result.payloads):
                    if kv.block_pool.cache_block(block, h):
                        out.kv_loads.append((block.block_id, payload))
                self.kv_tier.finish_load(result, now - job.start)
                kv.free(req)  # (tail first: the loaded blocks wait in the free queue with their hashes)
        for job in sorted(done, key=lambda j: j.request.queue_seq, reverse=True):  # front of the queue, in order
            job.request.status = RequestStatus.WAITING
            self._enqueue(job.request, preempted=True)

    def _abort_kv_load(self, req: Request) -> bool:
        """Drop ``req``'s pending load, if any (its blocks are freed by ``_finish``, never filled or cached; the
        read finishes in the background and is discarded). True if it had one."""
        return self._kv_loads.pop(req.request_id, None) is not None

    def _preempt(self, req: Request) -> None:
        self._kv_looked_up.discard(req.request_id)  # (its blocks may have left the pool since)
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        self._drafts.pop(req.request_id, None)  # drafts for a position it may not reach as planned
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, preempted=True)

    # ------------------------------------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[Request]:
        """Advance ``num_computed_tokens``, append the step's tokens, and retire finished requests at once.

        A request that verified ``k`` drafts and got ``a + 1`` tokens (``a`` accepted + the recovered or bonus one)
        is rolled back by the ``k - a`` rejected drafts, and blocks only they needed are released. Tokens are
        appended one by one; the first that finishes the request ends it and the rest are dropped with their K/V.
        A request finishes with ``"stop"`` on a model end token (unless ``ignore_eos``) or a ``stop_token_ids``
        token (both only after ``min_tokens``), and with ``"length"`` at ``max_tokens`` or ``max_model_len``.
        Finished requests' blocks are freed here, so the next step can reuse them.

        Returns:
            the requests that received tokens this step (finished ones and newly started forks included), in
            schedule order.
        """
        now = time.monotonic()
        kv = self.kv_cache_manager
        updated = []
        sampled, logprobs = model_output.sampled_token_ids, model_output.logprobs
        for s in scheduler_output.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += len(s.token_ids)
            tokens = sampled.get(s.request_id, ())
            if model_output.prompt_logprobs:
                req.prompt_logprobs.extend(model_output.prompt_logprobs.get(s.request_id, ()))
                req.prompt_logprob_ranks.extend(model_output.prompt_logprob_ranks.get(s.request_id, ()))
            if s.spec_token_ids:
                req.num_computed_tokens -= len(s.spec_token_ids) - (len(tokens) - 1)
                kv.trim(req)
            if not tokens:  # a prompt chunk that does not reach the end
                kv.cache_computed_blocks(req)
                continue
            if logprobs and s.request_id in logprobs:
                req.output_logprobs.append(logprobs[s.request_id])
            if req.first_token_time is None:
                req.first_token_time = now
            status = None
            for token in tokens:
                req.output_token_ids.append(token)
                status = self._check_stop(req, token)
                if status is not None:  # tokens accepted after a stop are dropped, and so is their K/V
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                    break
            kv.cache_computed_blocks(req)
            children = req.fork_children
            if children:
                req.fork_children = []
            for child in children:  # parallel sampling: the other samples share the prompt's blocks
                kv.fork(req, child)
            if status is not None:
                self._finish(req, status)
            updated.append(req)
            for child in children:
                self._start_fork(req, child, model_output.sampled_token_ids[child.request_id][0],
                                 model_output.logprobs.get(child.request_id), now)
                updated.append(child)
        return updated

    def _start_fork(self, parent: Request, child: Request, token: int, logprobs, now: float) -> None:
        """Start a forked sample: its blocks are the parent's (``fork``), its first token was sampled from the
        parent's prompt logits this step."""
        child.num_computed_tokens = len(child.prompt_token_ids)
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time = now
        child.status = RequestStatus.RUNNING
        child.output_token_ids.append(token)
        child.prompt_logprobs = parent.prompt_logprobs  # scored once, by the parent (complete now)
        child.prompt_logprob_ranks = parent.prompt_logprob_ranks
        if logprobs is not None:
            child.output_logprobs.append(logprobs)
        self.running.append(child)
        status = self._check_stop(child, token)
        if status is not None:
            self._finish(child, status)

    def _check_stop(self, req: Request, token: int):
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not sp.ignore_eos and token in self.eos_token_ids:
                req.stop_reason = None if token == self.eos_token_id else token
                return RequestStatus.FINISHED_STOPPED
        grammar = req.grammar
        if grammar is not None:  # structured outputs: the matcher takes the appended token
            grammar.sync(req.output_token_ids)
            if grammar.finished:  # the grammar allows nothing more
                return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.max_tokens or req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish (e.g. abort, or stop on a stop string) the given requests wherever they are; unknown or
        already finished ids are ignored. Their blocks return to the pool at once."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif not self._abort_kv_load(req):
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finish_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        self.kv_cache_manager.free(req)
        self.requests.pop(req.request_id, None)
        self._drafts.pop(req.request_id, None)
        self._kv_looked_up.discard(req.request_id)
