"""Per-request output state: incremental text, stop strings, and ``RequestOutput`` construction."""

from __future__ import annotations

from typing import Optional

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus


class _State:
    __slots__ = ("detok", "num_sent_tokens")

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.num_sent_tokens = 0


class OutputProcessor:
    """Turns requests that received tokens into ``RequestOutput`` objects (cumulative values plus deltas)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict = {}

    def add_request(self, req: Request) -> None:
        sp = req.sampling_params
        self.states[req.request_id] = _State(
            IncrementalDetokenizer(self.tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens)
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def update_text(self, req: Request) -> Optional[str]:
        """Detokenize the request's new tokens; returns the stop string if one matched (the caller finishes it).

        A token that ends the request by ``stop_token_ids`` or EOS is not added to the text.
        """
        st = self.states[req.request_id]
        new_tokens = req.output_token_ids[len(st.detok.token_ids) :]
        if req.status is RequestStatus.FINISHED_STOPPED:
            new_tokens = new_tokens[:-1]  # finished by EOS / stop_token_ids: that token is not text
        for t in new_tokens:
            matched = st.detok.add_token(t)
            if matched is not None:
                return matched
        return None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's ``RequestOutput``; drops its state once it is finished."""
        st = self.states[req.request_id]
        finished = req.status.finished
        if finished:
            st.detok.flush()
        delta_text = st.detok.take_delta(finished)
        delta_tokens = req.output_token_ids[st.num_sent_tokens :]
        st.num_sent_tokens = len(req.output_token_ids)
        lps = req.output_logprobs if req.sampling_params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=st.detok.text[: st.detok.num_emitted_chars],
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(lps) if lps is not None else None,
            cumulative_logprob=(
                sum(e[t] for e, t in zip(lps, req.output_token_ids)) if lps is not None else None
            ),
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_output_tokens=len(req.output_token_ids),
            num_preemptions=req.num_preemptions,
        )
        if finished:
            self.remove(req.request_id)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, metrics)
