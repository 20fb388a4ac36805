"""What the samplers need of one sample, in one object: ``SamplingState``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.sample.thinking import ThinkingBudget
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the samplers need of one sample: its parameters, its token history (for penalties and
    ``min_tokens``) and its generator.

    Built once per request (``Request.sampling_state``); ``prompt_token_ids`` and ``output_token_ids`` are the
    request's own lists (references, not copies), so the view is current whenever a step samples from it.

    Attributes:
        request_id: the sample's request id.
        params: its ``SamplingParams``.
        prompt_token_ids, output_token_ids: token ids (ints).
        generator: a seeded ``torch.Generator`` (``params.seed`` set), or ``None`` (the sampler's shared one).
        bad_words_token_ids: ``params.bad_words`` as token-id sequences (set when the request is added).
        thinking: the sample's ``ThinkingBudget`` (``params.thinking_token_budget`` set), else ``None``.
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator] = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    thinking: Optional[ThinkingBudget] = None
