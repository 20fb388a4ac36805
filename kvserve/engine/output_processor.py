"""Per-request output state: incremental text, stop strings, and ``RequestOutput`` construction.

A request with ``n > 1`` runs as n sample requests (``parent_id`` = the user's id, ``sample_index`` 0..n-1);
their completions are gathered into one ``RequestOutput`` with n ``CompletionOutput`` entries.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus


class _State:
    __slots__ = ("detok", "num_sent_tokens", "last", "stop")

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.num_sent_tokens = 0
        self.last: Optional[CompletionOutput] = None
        self.stop: Optional[tuple[str, int]] = None  # (stop string, output tokens kept) once one matched


class OutputProcessor:
    """Turns requests that received tokens into ``RequestOutput`` objects (cumulative values plus deltas)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict = {}
        self.groups: dict = {}  # user request id -> its sample requests, in sample order

    def add_request(self, samples: list) -> None:
        """Track one user request: a list with its single ``Request``, or its n sample requests."""
        for req in samples:
            sp = req.sampling_params
            self.states[req.request_id] = _State(
                IncrementalDetokenizer(self.tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens,
                                       sp.min_tokens)
            )
        self.groups[samples[0].parent_id or samples[0].request_id] = samples

    def remove(self, group_id: str) -> None:
        for req in self.groups.pop(group_id, ()):
            self.states.pop(req.request_id, None)

    def update_text(self, req: Request) -> Optional[tuple[str, int]]:
        """Detokenize the request's new tokens; on a stop-string match returns ``(stop string, n)``: the match
        completed at output token ``n - 1``. The caller finishes the request as stopped (the scheduler's one
        finish path, as vLLM aborts it); its outputs from now on end there: ``token_ids`` and ``logprobs`` hold
        its first ``n`` output tokens (a multi-token step, speculative decoding, may have appended more to the
        request), ``finish_reason`` is ``"stop"`` and ``stop_reason`` the string, also when a later token of the
        same step had ended it otherwise (``max_tokens``).

        A token that ends the request by ``stop_token_ids`` or EOS is not added to the text.
        """
        st = self.states[req.request_id]
        new_tokens = req.output_token_ids[len(st.detok.token_ids) :]
        if req.status is RequestStatus.FINISHED_STOPPED:
            new_tokens = new_tokens[:-1]  # finished by EOS / stop_token_ids: that token is not text
        for t in new_tokens:
            matched = st.detok.add_token(t)
            if matched is not None:
                st.stop = (matched, len(st.detok.token_ids))
                return st.stop
        return None

    def make_outputs(self, updated: list) -> list:
        """One ``RequestOutput`` per user request with a sample among ``updated``; finished ones are forgotten."""
        for req in updated:
            self.states[req.request_id].last = self._completion(req)
        outputs, seen = [], set()
        for req in updated:
            gid = req.parent_id or req.request_id
            if gid in seen:
                continue
            seen.add(gid)
            samples = self.groups[gid]
            completions = [self._current(s, updated) for s in samples]
            finished = all(s.status.finished for s in samples)
            lead = samples[0]
            times = [s.finish_time for s in samples]
            firsts = [s.first_token_time for s in samples if s.first_token_time is not None]
            metrics = RequestMetrics(
                arrival_time=lead.arrival_time,
                first_scheduled_time=lead.first_scheduled_time,
                first_token_time=min(firsts) if firsts else None,
                finish_time=max(times) if finished else None,
                num_output_tokens=sum(self._num_kept(s) for s in samples),
                num_preemptions=sum(s.num_preemptions for s in samples),
            )
            scored = lead.sampling_params.prompt_logprobs is not None
            outputs.append(RequestOutput(gid, lead.prompt, lead.prompt_token_ids, completions, finished, metrics,
                                         prompt_logprobs=list(lead.prompt_logprobs) if scored else None,
                                         prompt_logprob_ranks=list(lead.prompt_logprob_ranks) if scored else None))
            if finished:
                self.remove(gid)
        return outputs

    def _current(self, sample: Request, updated: list) -> CompletionOutput:
        last = self.states[sample.request_id].last
        if last is None:  # a sample not started yet
            return CompletionOutput(index=sample.sample_index, text="", token_ids=[])
        if sample in updated:
            return last
        return dataclasses.replace(last, delta_text="", delta_token_ids=[])

    def _num_kept(self, req: Request) -> int:
        """Output tokens of ``req`` its outputs show: up to a stop string's last token, else all."""
        st = self.states.get(req.request_id)
        return st.stop[1] if st is not None and st.stop is not None else len(req.output_token_ids)

    def _completion(self, req: Request) -> CompletionOutput:
        st = self.states[req.request_id]
        finished = req.status.finished
        if finished:
            st.detok.flush()
        delta_text = st.detok.take_delta(finished)
        n = self._num_kept(req)
        token_ids = req.output_token_ids[:n]
        delta_tokens = token_ids[st.num_sent_tokens :]
        st.num_sent_tokens = n
        lps = req.output_logprobs[:n] if req.sampling_params.logprobs is not None else None
        finish_reason, stop_reason = req.status.finish_reason, req.stop_reason
        if st.stop is not None:
            finish_reason, stop_reason = "stop", st.stop[0]
        return CompletionOutput(
            index=req.sample_index,
            text=st.detok.text[: st.detok.num_emitted_chars],
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=lps,
            cumulative_logprob=sum(e[t] for e, t in zip(lps, token_ids)) if lps is not None else None,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )
