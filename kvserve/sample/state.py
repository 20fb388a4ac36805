"""What the samplers need of one sample, in one object: ``SamplingState``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

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
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator] = None
