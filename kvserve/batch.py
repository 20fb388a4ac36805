"""The one flat-batch builder: a step plan -> the tensors a forward pass over the paged cache reads, and the
layout of the logits rows it returns.

Flat batch of ``T`` tokens over ``B`` requests (request ``b`` owns rows ``query_start_loc[b] : query_start_loc[b+1]``,
the layout of vLLM's ``InputBatch`` / FlashAttention's varlen API). Used by the model runner for the target model,
by tensor-parallel workers and by the draft-model proposer for its own cache, so there is one copy of the slot
arithmetic and one owner of the logits-row layout (``LogitsLayout``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np
import torch


class BatchEntry(Protocol):
    """What the builder reads of one request's share of a step (``ScheduledRequest`` is one)."""

    token_ids: list[int]  # tokens to feed, at positions start_pos ..
    start_pos: int  # tokens of the request already in the cache
    block_ids: list[int]  # its block table, covering start_pos + len(token_ids) tokens
    spec_token_ids: list[int]  # the last len(spec_token_ids) of token_ids are drafts to verify
    samples: bool  # a next token is sampled from the last row (from every draft row too, when verifying)
    sampling_states: list  # samples drawn from the last row (n > 1 forks: several), when ``samples``


@dataclass(frozen=True)
class LogitsLayout:
    """Which logits row belongs to what, the one definition the batch builder, the model runner and the prompt
    scorer share. The model returns ``[S, V]`` logits, one row per ``logits_indices`` entry:

    - rows ``[0, num_sampling_rows)``: per sampling entry in plan order, one row per sample drawn from its last
      position (``sample_rows``; an ``n > 1`` fork repeats the row once per sample), or ``k + 1`` rows of the
      positions of a request verifying ``k`` drafts (``verify_rows``);
    - rows ``[num_sampling_rows, S)``: the scored prompt rows (``prompt_logprobs``), in entry order.

    Attributes:
        sample_rows: ``(entry, sample, row)``: plan entry ``entry``'s sample ``sample`` (an index into its
            ``sampling_states``) samples from logits row ``row``.
        verify_rows: ``(entry, first_row)``: plan entry ``entry`` verifies its ``k`` drafts on rows
            ``first_row .. first_row + k``.
        num_sampling_rows: rows of both kinds.
    """

    sample_rows: tuple[tuple[int, int, int], ...] = ()
    verify_rows: tuple[tuple[int, int], ...] = ()
    num_sampling_rows: int = 0


@dataclass
class InputBatch:
    """The step's flat batch, on ``device``.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 absolute position of each token in its sequence.
        slot_mapping: ``[T]`` int64 cache slot of each token, ``block_id * block_size + position % block_size``.
        query_start_loc: ``[B + 1]`` int64 prefix sums of the query lengths.
        seq_lens: ``[B]`` int64 tokens in context after this step (computed before + scheduled now).
        block_tables: ``[B, max_blocks]`` int64, each request's block ids in logical order, padded with 0.
        logits_indices: ``[S]`` int64 flat rows whose next-token logits are wanted: the last row of each sampling
            request (repeated once per sample of an ``n > 1`` fork), or the last ``k + 1`` rows of a request
            verifying ``k`` drafts.
        block_size: tokens per block.
        query_lens, context_lens: ``B`` ints on the host (query tokens, and ``seq_lens``), for metadata builders.
        logits_layout: what each logits row is (``LogitsLayout``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    logits_layout: LogitsLayout = field(default_factory=LogitsLayout)
    #: ``logits_indices`` when, as built, it was every row in order (``0 .. T-1``: a step of one token per sampling
    #: entry); ``logits_rows_are_all`` compares by identity, so a replaced ``logits_indices`` is never mistaken.
    all_rows_indices: Optional[torch.Tensor] = field(default=None, repr=False)

    def logits_rows_are_all(self) -> bool:
        """Whether the logits rows are every row in order, known without reading the tensor (the forward then
        skips the gather)."""
        return self.all_rows_indices is not None and self.logits_indices is self.all_rows_indices

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


class StepBuffers:
    """Persistent CPU tensors a runner's flat batch is written into, step after step, instead of seven new tensors
    per step (vLLM's ``InputBatch`` keeps its step tensors the same way). Each named buffer is an int64 tensor that
    grows (doubling) when a step needs more, so after the largest step it is never reallocated.

    The tensors of an ``InputBatch`` built into these buffers are views: valid until the next build.
    """

    def __init__(self):
        self._bufs: dict = {}  # name -> (torch tensor, numpy view of it)

    def put(self, name: str, a: np.ndarray) -> torch.Tensor:
        """Copy int64 array ``a`` into buffer ``name``; returns a contiguous view of ``a.shape``."""
        n = a.size
        buf = self._bufs.get(name)
        if buf is None or buf[0].numel() < n:
            t = torch.zeros(max(n, 64, 2 * (0 if buf is None else buf[0].numel())), dtype=torch.long)
            buf = self._bufs[name] = (t, t.numpy())
        buf[1][:n] = a.reshape(-1)
        return buf[0][:n] if a.ndim == 1 else buf[0][:n].view(a.shape)


def build_input_batch(entries: Sequence[BatchEntry], block_size: int, device: str = "cpu",
                      buffers: StepBuffers | None = None) -> InputBatch:
    """Flatten ``B >= 1`` plan entries into an ``InputBatch``, vectorised over tokens (one Python pass over the
    requests for their token lists and block tables). When every entry feeds one token (decode steps, and a
    1-token prompt or final chunk among them), the ids, positions and slots are Python lists built per entry
    instead: no per-token vector arithmetic is worth its fixed cost at one token per request.

    Args:
        entries: the scheduled requests, in flat-batch order; each feeds ``>= 1`` token.
        block_size: tokens per KV block.
        device: where the tensors go (``"cpu"``, ``"cuda"``).
        buffers: on ``"cpu"``, persistent ``StepBuffers`` to write the tensors into (views, valid until the next
            build); ``None``: new tensors.

    Raises:
        ValueError: an entry feeds no token, or its block table is too short for its positions.
    """
    n = len(entries)
    query_lens = [len(e.token_ids) for e in entries]
    if n == 0 or min(query_lens) < 1:
        raise ValueError("every batch entry must feed at least one token")
    one_token = max(query_lens) == 1
    if one_token:
        input_ids = [e.token_ids[0] for e in entries]
        positions = [e.start_pos for e in entries]
        seq_lens = [p + 1 for p in positions]
        qsl = list(range(n + 1))
    else:
        ql = np.asarray(query_lens, dtype=np.int64)
        starts = np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(ql, out=qsl[1:])
        t = int(qsl[-1])
        input_ids = np.fromiter(itertools.chain.from_iterable(e.token_ids for e in entries), dtype=np.int64, count=t)
        req_index = np.repeat(np.arange(n), ql)
        positions = np.arange(t, dtype=np.int64) - qsl[req_index] + starts[req_index]
        seq_lens = (starts + ql).tolist()
    max_blocks = max(len(e.block_ids) for e in entries)
    tables = np.zeros((n, max_blocks), dtype=np.int64)
    for b, e in enumerate(entries):
        if len(e.block_ids) * block_size < seq_lens[b]:
            raise ValueError(f"entry {b}: {len(e.block_ids)} blocks cannot hold {seq_lens[b]} tokens")
        tables[b, : len(e.block_ids)] = e.block_ids
    if one_token:
        slot_mapping = [e.block_ids[p // block_size] * block_size + p % block_size for e, p in zip(entries, positions)]
    else:
        slot_mapping = tables[req_index, positions // block_size] * block_size + positions % block_size
    logits_indices, sample_rows, verify_rows = [], [], []
    for b, e in enumerate(entries):
        if not e.samples:
            continue
        end = int(qsl[b + 1])
        k = len(e.spec_token_ids)
        if k:
            verify_rows.append((b, len(logits_indices)))
            logits_indices.extend(range(end - 1 - k, end))
        else:
            for j in range(max(1, len(e.sampling_states))):
                sample_rows.append((b, j, len(logits_indices)))
                logits_indices.append(end - 1)

    def tensor(name: str, a) -> torch.Tensor:
        if buffers is not None and device == "cpu":
            return buffers.put(name, np.asarray(a, dtype=np.int64))
        return torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device)

    logits = tensor("logits_indices", logits_indices)
    # the lengths first: a prompt chunk has many rows and few logits rows
    every_row = len(logits_indices) == len(input_ids) and logits_indices == list(range(len(input_ids)))
    return InputBatch(
        input_ids=tensor("input_ids", input_ids),
        positions=tensor("positions", positions),
        slot_mapping=tensor("slot_mapping", slot_mapping),
        query_start_loc=tensor("query_start_loc", qsl),
        seq_lens=tensor("seq_lens", seq_lens),
        block_tables=tensor("block_tables", tables),
        logits_indices=logits,
        block_size=block_size,
        query_lens=query_lens,
        context_lens=seq_lens,
        all_rows_indices=logits if every_row else None,
        logits_layout=LogitsLayout(tuple(sample_rows), tuple(verify_rows), len(logits_indices)),
    )


def prompt_logprob_rows(entries: Sequence, batch: InputBatch) -> torch.Tensor:
    """The flat rows of ``batch`` whose next prompt token is scored (``prompt_logprobs``), in entry order.

    Entry ``b`` scores its rows ``prompt_logprob_start .. + len(prompt_logprob_targets)`` (``ScheduledRequest``
    fields; entries without them score none). Returns ``[R]`` int64 on the batch's device, ``R`` = all targets.
    """
    starts = itertools.accumulate(batch.query_lens, initial=0)
    rows = [q0 + e.prompt_logprob_start + j for e, q0 in zip(entries, starts)
            for j in range(len(getattr(e, "prompt_logprob_targets", ())))]
    return torch.as_tensor(rows, dtype=torch.long).to(batch.input_ids.device)


def build_step_batch(entries: Sequence, block_size: int, device: str = "cpu",
                     buffers: StepBuffers | None = None) -> InputBatch:
    """The batch one step's forward runs on, on every rank alike: ``build_input_batch`` plus, after the sampling
    rows, the rows whose next prompt token is scored (``prompt_logprob_rows``) in ``logits_indices``
    (``LogitsLayout``). ``buffers``: as ``build_input_batch``."""
    batch = build_input_batch(entries, block_size, device, buffers)
    if any(getattr(e, "prompt_logprob_targets", None) for e in entries):
        batch.logits_indices = torch.cat([batch.logits_indices, prompt_logprob_rows(entries, batch)])
    return batch
