"""Benchmark workloads: lists of ``BenchRequest`` (prompt token ids, output length, arrival offset).

- ``synthetic_skewed``: random prompt tokens, output lengths skewed (most short, a quarter long), the workload
  where iteration-level batching pays off most.
- ``azure_trace``: rows sampled from the Azure LLM inference trace 2023 (Splitwise; ``../shared/data/
  azure_llm_2023``), context and generated token counts divided by a scale factor and capped to fit a 2-core CPU.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional, Union

#: Token ids used for synthetic prompts: ordinary vocabulary, away from special tokens.
SAFE_TOKEN_RANGE = (1000, 30000)


@dataclass
class BenchRequest:
    """One benchmark request: ``prompt_token_ids``, ``output_len`` tokens (forced with ignore_eos), and
    ``arrival_s`` seconds after the start of the run (0 for offline runs)."""

    prompt_token_ids: list
    output_len: int
    arrival_s: float = 0.0


@dataclass
class LoadRequest:
    """One request to send: ``prompt`` (text or token ids), ``output_len`` (``max_tokens``), ``arrival_s`` after
    the start (``None``: from ``--request-rate``)."""

    prompt: Union[str, list]
    output_len: int
    arrival_s: Optional[float] = None


def default_data_dir() -> Path:
    """``../shared/data`` next to the repository root."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _random_prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(n)]


def synthetic_skewed(num_requests: int, seed: int = 0, input_len=(32, 128), short=(8, 32), long=(128, 256),
                     long_fraction: float = 0.25) -> list:
    """Random prompts of ``input_len`` tokens (uniform, inclusive); outputs uniform in ``short``, or in ``long``
    with probability ``long_fraction``."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        lo, hi = long if rng.random() < long_fraction else short
        out.append(BenchRequest(_random_prompt(rng, rng.randint(*input_len)), rng.randint(lo, hi)))
    return out


def azure_trace(num_requests: int, seed: int = 0, data_dir=None, kind: str = "conv", scale: float = 8.0,
                max_input_len: int = 512, max_output_len: int = 256, time_scale: float = 1.0) -> list:
    """Sample ``num_requests`` consecutive rows (from a seeded random start) of the Azure 2023 trace.

    Token counts are divided by ``scale`` and capped at ``max_input_len`` / ``max_output_len`` (this CPU is ~1000x
    slower than the trace's GPUs); arrival offsets come from the timestamps, multiplied by ``time_scale``.

    Raises:
        ValueError: the trace file is missing.
    """
    path = Path(data_dir or default_data_dir()) / "azure_llm_2023" / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.exists():
        raise ValueError(f"Azure trace not found at {str(path)!r}; pass --data-dir")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    start = rng.randrange(0, max(1, len(rows) - num_requests))
    picked = rows[start : start + num_requests]
    t0 = _parse_ts(picked[0]["TIMESTAMP"])
    out = []
    for r in picked:
        n_in = max(1, min(max_input_len, round(int(r["ContextTokens"]) / scale)))
        n_out = max(1, min(max_output_len, round(int(r["GeneratedTokens"]) / scale)))
        out.append(BenchRequest(_random_prompt(rng, n_in), n_out, (_parse_ts(r["TIMESTAMP"]) - t0) * time_scale))
    return out


def _parse_ts(ts: str) -> float:
    # '2023-11-16 18:15:46.6805900': seven fractional digits, more than datetime parses
    head, _, frac = ts.partition(".")
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))


def random_lengths(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list:
    """Random-token prompts with lengths uniform in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``
    (at least 1), for input and output alike (vLLM's "random" dataset).

    Raises:
        ValueError: a length below 1 or ``range_ratio`` outside ``[0, 1)``.
    """
    if input_len < 1 or output_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError(f"need input_len, output_len >= 1 and range_ratio in [0, 1), got {input_len}, "
                         f"{output_len}, {range_ratio}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [BenchRequest(_random_prompt(rng, draw(input_len)), draw(output_len)) for _ in range(num_requests)]


def prefix_repetition(num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                      seed: int = 0) -> list:
    """Requests that share ``num_prefixes`` random prefixes of ``prefix_len`` tokens, each followed by a random
    suffix of ``suffix_len`` tokens (vLLM's "prefix_repetition" dataset): ``num_requests // num_prefixes`` per
    prefix (the first ``num_requests % num_prefixes`` prefixes one more), in a seeded random order.

    Raises:
        ValueError: a length below 1 or ``num_prefixes`` outside ``[1, num_requests]``.
    """
    if min(prefix_len, suffix_len, output_len) < 1 or not 1 <= num_prefixes <= num_requests:
        raise ValueError(f"need prefix, suffix and output lengths >= 1 and 1 <= num_prefixes <= num_requests, got "
                         f"{prefix_len}, {suffix_len}, {output_len}, {num_prefixes}, {num_requests}")
    rng = random.Random(seed)
    prefixes = [_random_prompt(rng, prefix_len) for _ in range(num_prefixes)]
    out = [BenchRequest(prefixes[i % num_prefixes] + _random_prompt(rng, suffix_len), output_len)
           for i in range(num_requests)]
    rng.shuffle(out)
    return out


def sharegpt_prompts(num_requests: int, seed: int = 0, data_dir=None, max_chars: int = 4000) -> list:
    """``num_requests`` first-turn human prompts (text) from ``../shared/data/sharegpt/ShareGPT_V3_filtered_1000.json``
    (a JSON list of ``{"id", "conversations": [{"from": "human", "value": str}, ...]}``), in a seeded random order,
    skipping empty ones and those longer than ``max_chars``; repeats the list when more are asked than it holds.

    Raises:
        ValueError: the file is missing or holds no usable prompt.
    """
    import json

    path = Path(data_dir or default_data_dir()) / "sharegpt" / "ShareGPT_V3_filtered_1000.json"
    if not path.exists():
        raise ValueError(f"ShareGPT sample not found at {str(path)!r}; pass --data-dir")
    rows = json.loads(path.read_text(encoding="utf-8"))
    prompts = []
    for row in rows:
        turns = row.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 0 < len(turns[0].get("value") or "") <= max_chars:
            prompts.append(turns[0]["value"])
    if not prompts:
        raise ValueError(f"no usable prompt in {str(path)!r}")
    random.Random(seed).shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(num_requests)]
