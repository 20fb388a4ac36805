"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` and ``RequestMetrics``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: sample index (0).
        text: output text so far (stop string cut unless ``include_stop_str_in_output``).
        token_ids: generated token ids so far.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it, else ``None``.
        logprobs: per generated token, ``{token_id: logprob}`` (when requested), else ``None``.
        cumulative_logprob: sum of the sampled tokens' logprobs (when requested), else ``None``.
        delta_text, delta_token_ids: what is new since the previous output of this request (for streaming).
    """

    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    delta_text: str = ""
    delta_token_ids: list = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) and derived latencies of one request.

    ``ttft`` = first token - arrival; ``tpot`` = (finish - first token) / (output tokens - 1), the mean time per
    output token after the first; ``e2e`` = finish - arrival. Each is ``None`` until defined.
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the id given to ``add_request``.
        prompt: the prompt text (``None`` if token ids were given).
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput``.
        finished: whether the request is done.
        metrics: ``RequestMetrics``.
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` is set, vLLM's shape: one entry per prompt token,
            ``None`` for the first (nothing precedes it), then ``{token_id: logprob}`` with the prompt token and the
            top ``prompt_logprobs`` alternatives (log-softmax of the raw logits at the position before it); else
            ``None``.
        prompt_logprob_ranks: with ``prompt_logprobs``, each prompt token's rank in its entry (``None`` for the
            first; 1 = the most likely token; vLLM's ``Logprob.rank``); else ``None``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None
    prompt_logprob_ranks: Optional[list] = None
