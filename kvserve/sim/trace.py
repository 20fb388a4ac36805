"""Traces for ``kvserve sim``: lists of ``TraceRequest`` (arrival, prompt and output lengths, optional prefix blocks).

Readers (each raises ``ValueError`` naming the file, the line and the field of a malformed entry):

- ``read_azure``: the Azure LLM inference trace 2023 (Splitwise; CSV ``TIMESTAMP, ContextTokens, GeneratedTokens``).
- ``read_mooncake``: the Mooncake FAST'25 traces (JSONL ``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``: one id per 512-token prefix block; equal leading ids = a shareable prefix).
- ``read_sharegpt``: ShareGPT first-turn prompts, their token counts by the model's tokenizer; outputs fixed.
- ``read_jsonl``: one object per line: ``arrival_s``, ``prompt_tokens``, ``output_tokens``, optional
  ``prefix_block_ids`` (list of ints, one per ``prefix_block_tokens`` tokens) and ``priority``.

``prompt_token_ids`` turns a request into token ids for the real ``KVCacheManager``: each prefix block id maps to a
fixed run of token ids (same id, same tokens, so the prefix cache hits exactly where the trace shares blocks), and
the rest of the prompt is unique to the request.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
JSONL_REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")
JSONL_OPTIONAL = ("prefix_block_ids", "priority")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds after the trace's start.
        prompt_len: prompt tokens, >= 1.
        output_len: tokens to generate (forced: the simulated request ignores EOS), >= 1.
        prefix_ids: ids of the prompt's leading blocks of ``prefix_block_tokens`` tokens each; equal ids carry equal
            tokens. Empty: the prompt shares nothing.
        prefix_block_tokens: tokens per prefix id.
        priority: lower first under ``scheduling_policy="priority"``.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_ids: tuple = ()
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    priority: int = 0
    token_ids: Optional[list] = field(default=None, repr=False)  # explicit prompt ids (validation replays)


def prompt_token_ids(req: TraceRequest, index: int) -> list[int]:
    """Token ids for request number ``index``: ``prefix_block_tokens`` ids per prefix id (``(id, j)`` -> a fixed
    positive int), then ids unique to the request (negative ints, never shared), ``prompt_len`` in all."""
    if req.token_ids is not None:
        return req.token_ids
    c = req.prefix_block_tokens
    out: list[int] = []
    for h in req.prefix_ids:
        if len(out) >= req.prompt_len:
            break
        base = (h + 1) * c
        out.extend(range(base, base + c))
    del out[req.prompt_len:]
    start = -(index + 1) * (1 << 24)
    out.extend(range(start, start + req.prompt_len - len(out)))
    return out


def _int_field(value, name: str, where: str, low: int, text: bool = False) -> int:
    """``value`` as an integer >= ``low``; a string only where the format is text (``text``: a CSV cell), so a
    JSON ``"10"`` is refused as JSON's other mistyped values are.

    Raises:
        ValueError: naming ``where``, the field and the allowed range.
    """
    try:
        if isinstance(value, bool) or (isinstance(value, str) and not text):
            raise ValueError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field {name!r} must be an integer >= {low}, got {value!r}") from None
    if n < low:
        raise ValueError(f"{where}: field {name!r} must be an integer >= {low}, got {value!r}")
    return n


def _float_field(value, name: str, where: str) -> float:
    """``value`` (a JSON number, not a string) as a finite float >= 0.

    Raises:
        ValueError: naming ``where``, the field and the allowed range.
    """
    try:
        if isinstance(value, (bool, str)):
            raise ValueError
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field {name!r} must be a number >= 0, got {value!r}") from None
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{where}: field {name!r} must be a number >= 0, got {value!r}")
    return x


def _scaled(n: int, scale: float, cap: Optional[int]) -> int:
    m = max(1, round(n / scale))
    return min(m, cap) if cap else m


def _parse_ts(ts: str) -> float:
    head, _, frac = ts.strip().partition(".")  # seven fractional digits: more than datetime parses
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))


def _window(n_rows: int, num_requests: Optional[int], start: int) -> tuple[int, int]:
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    end = n_rows if num_requests is None else min(n_rows, start + num_requests)
    if start >= end:
        raise ValueError(f"the trace has {n_rows} requests; none left from row {start}")
    return start, end


def read_azure(path, num_requests: Optional[int] = None, start: int = 0, length_scale: float = 1.0,
               max_input_len: Optional[int] = None, max_output_len: Optional[int] = None) -> list[TraceRequest]:
    """Rows ``[start, start + num_requests)`` of an Azure 2023 trace CSV, arrivals relative to the first of them.

    Token counts are divided by ``length_scale`` (rounded, at least 1) and capped at ``max_input_len`` /
    ``max_output_len`` when given.

    Raises:
        ValueError: a missing file or column, an unknown column, a malformed row (with its line number).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace file not found: {str(path)!r}")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file")
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        unknown = [c for c in header if c not in AZURE_COLUMNS]
        if missing or unknown:
            raise ValueError(f"{path}: line 1: expected columns {list(AZURE_COLUMNS)}; "
                             f"missing {missing}, unknown {unknown}")
        col = {c: header.index(c) for c in AZURE_COLUMNS}
        rows = list(reader)
    lo, hi = _window(len(rows), num_requests, start)
    out, t0 = [], None
    for i in range(lo, hi):
        row, where = rows[i], f"{path}: line {i + 2}"
        if len(row) != len(header):
            raise ValueError(f"{where}: expected {len(header)} fields, got {len(row)}")
        try:
            ts = _parse_ts(row[col["TIMESTAMP"]])
        except ValueError:
            raise ValueError(f"{where}: field 'TIMESTAMP' must look like '2023-11-16 18:15:46.68', "
                             f"got {row[col['TIMESTAMP']]!r}") from None
        t0 = ts if t0 is None else t0
        n_in = _int_field(row[col["ContextTokens"]], "ContextTokens", where, 1, text=True)
        n_out = _int_field(row[col["GeneratedTokens"]], "GeneratedTokens", where, 1, text=True)
        out.append(TraceRequest(max(0.0, ts - t0), _scaled(n_in, length_scale, max_input_len),
                                _scaled(n_out, length_scale, max_output_len)))
    return out


def _read_json_lines(path: Path, lo_hi=None):
    if not path.exists():
        raise ValueError(f"trace file not found: {str(path)!r}")
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_bench_records(records: list) -> list:
    """The requests a load test actually sent (the ``requests`` of a ``kvserve bench serve --output-json``
    report) as a trace: each at its actual send offset (``start_s``), with its prompt token ids and ``output_len``
    tokens (forced, as ``ignore_eos`` does), in send order; requests never sent (``start_s`` null) are left out.

    Raises:
        ValueError: a record without ``prompt_token_ids`` (a text prompt: the client never saw its tokens) or
            without ``output_len``.
    """
    sent = [r for r in records if r.get("start_s") is not None]
    for i, r in enumerate(sent):
        if not isinstance(r.get("prompt_token_ids"), list) or not isinstance(r.get("output_len"), int):
            raise ValueError(f"request record {i} has no prompt_token_ids / output_len (text prompts cannot be "
                             f"replayed; use a dataset that sends token ids)")
    sent.sort(key=lambda r: r["start_s"])
    return [TraceRequest(float(r["start_s"]), len(r["prompt_token_ids"]), r["output_len"],
                         token_ids=list(r["prompt_token_ids"])) for r in sent]


def _records(path: Path, start: int, num_requests: Optional[int], required: tuple, optional: tuple = ()):
    """Yield ``("FILE: line N", object)`` for the JSON objects from the ``start``-th (0-based, blank lines not
    counted), at most ``num_requests`` of them, each with every ``required`` field and no field outside
    ``required + optional``.

    Raises:
        ValueError: malformed JSON, a missing or unknown field (with the line).
    """
    taken = 0
    for index, (lineno, obj) in enumerate(_read_json_lines(path)):
        if index < start:
            continue
        if num_requests is not None and taken >= num_requests:
            return
        where = f"{path}: line {lineno}"
        missing = [k for k in required if k not in obj]
        unknown = [k for k in obj if k not in tuple(required) + tuple(optional)]
        if missing or unknown:
            expected = (f"required {list(required)}, optional {list(optional)}" if optional
                        else f"expected {list(required)}")
            raise ValueError(f"{where}: missing field(s) {missing}, unknown field(s) {unknown}; {expected}")
        taken += 1
        yield where, obj


def read_mooncake(path, num_requests: Optional[int] = None, start: int = 0, length_scale: float = 1.0,
                  max_input_len: Optional[int] = None, max_output_len: Optional[int] = None) -> list[TraceRequest]:
    """Requests ``[start, start + num_requests)`` of a Mooncake JSONL trace.

    Each ``hash_id`` covers 512 tokens upstream; with ``length_scale`` s, prompts have ``ceil(input_length / s)``
    tokens and each id ``512 / s`` (rounded, >= 1), so the share of a prompt that is a cached prefix is unchanged.

    Raises:
        ValueError: a missing file, malformed JSON, a missing or unknown field, a bad value (with the line).
    """
    path = Path(path)
    block = max(1, round(MOONCAKE_BLOCK_TOKENS / length_scale))
    out, t0 = [], None
    for where, obj in _records(path, start, num_requests, MOONCAKE_FIELDS):
        ts = _float_field(obj["timestamp"], "timestamp", where) / 1000
        t0 = ts if t0 is None else t0
        n_in = _int_field(obj["input_length"], "input_length", where, 1)
        n_out = _int_field(obj["output_length"], "output_length", where, 1)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
            raise ValueError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
        p = max(1, math.ceil(n_in / length_scale))
        if max_input_len:
            p = min(p, max_input_len)
        out.append(TraceRequest(max(0.0, ts - t0), p, _scaled(n_out, length_scale, max_output_len), tuple(ids),
                                block))
    if not out:
        raise ValueError(f"{path}: no request from line {start + 1}")
    return out


def read_jsonl(path, num_requests: Optional[int] = None, start: int = 0,
               prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """A JSONL trace: ``{"arrival_s": 0.5, "prompt_tokens": 812, "output_tokens": 64, "prefix_block_ids": [3, 9],
    "priority": 0}`` per line (the last two optional), arrivals as given.

    Raises:
        ValueError: malformed JSON, a missing or unknown field, a bad value, arrivals out of order (with the line).
    """
    path = Path(path)
    if prefix_block_tokens < 1:
        raise ValueError(f"prefix_block_tokens must be >= 1, got {prefix_block_tokens}")
    out, last = [], 0.0
    for where, obj in _records(path, start, num_requests, JSONL_REQUIRED, JSONL_OPTIONAL):
        t = _float_field(obj["arrival_s"], "arrival_s", where)
        if t < last:
            raise ValueError(f"{where}: field 'arrival_s' goes back in time ({t} < {last}); sort the trace")
        last = t
        ids = obj.get("prefix_block_ids", [])
        if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
            raise ValueError(f"{where}: field 'prefix_block_ids' must be a list of integers >= 0")
        prio = obj.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ValueError(f"{where}: field 'priority' must be an integer, got {prio!r}")
        out.append(TraceRequest(t, _int_field(obj["prompt_tokens"], "prompt_tokens", where, 1),
                                _int_field(obj["output_tokens"], "output_tokens", where, 1), tuple(ids),
                                prefix_block_tokens, prio))
    if not out:
        raise ValueError(f"{path}: no request from line {start + 1}")
    return out


def read_sharegpt(path, num_requests: int, output_len: int, seed: int = 0, tokenizer=None,
                  max_input_len: Optional[int] = None) -> list[TraceRequest]:
    """``num_requests`` ShareGPT first-turn prompts (seeded order, repeated if needed) as lengths: prompt tokens
    by ``tokenizer`` (default: the default model's), ``output_len`` output tokens each, all arriving at 0 (give
    ``--request-rate`` for Poisson arrivals).

    Raises:
        ValueError: a missing or malformed file.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"ShareGPT file not found: {str(path)!r}")
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    texts = []
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        turns = row.get("conversations") if isinstance(row, dict) else None
        if turns and isinstance(turns[0], dict) and turns[0].get("from") == "human" and turns[0].get("value"):
            texts.append(turns[0]["value"])
    if not texts:
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [{{'from': 'human', 'value': ...}}]}}")
    if tokenizer is None:
        from kvserve.model.loader import _gguf_tokenizer, default_model_path

        tokenizer = _gguf_tokenizer(default_model_path())
    random.Random(seed).shuffle(texts)
    picked = [texts[i % len(texts)] for i in range(num_requests)]
    lens = {t: len(tokenizer.encode(t)) for t in set(picked)}
    return [TraceRequest(0.0, min(lens[t], max_input_len) if max_input_len else lens[t], output_len)
            for t in picked]


def poisson_arrivals(trace: list[TraceRequest], rate: float, seed: int = 0) -> None:
    """Replace the arrivals with a Poisson process at ``rate`` requests/s (``inf``: all at 0), in place.

    Raises:
        ValueError: ``rate`` not > 0.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    t = 0.0
    for i, r in enumerate(trace):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        r.arrival_s = t


def prefix_share(trace: list[TraceRequest]) -> float:
    """Fraction of prefix-id blocks that repeat an earlier request's block at the same position (the hit rate an
    unbounded cache would reach, in blocks; 0 for traces without prefix ids)."""
    seen, total, hits = set(), 0, 0
    for r in trace:
        chain = ()
        for h in r.prefix_ids:
            chain = chain + (h,)
            total += 1
            if chain in seen:
                hits += 1
            else:
                seen.add(chain)
    return hits / total if total else 0.0
