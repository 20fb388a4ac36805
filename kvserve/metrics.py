"""Serving metrics over a run's requests, shared by the load test (``kvserve bench serve``), the simulator
(``kvserve sim``, ``kvserve plan``) and the dashboard: what one request measured, percentiles, goodput SLOs, the
summary table. Nothing here imports the engine.

Terms (seconds unless named ``_ms``): TTFT, arrival to the first token; ITL, the gaps between later tokens; TPOT,
``(e2e - TTFT) / (output tokens - 1)``; e2e latency, arrival to the last token; goodput, requests per second that
met every SLO (DistServe, Zhong et al., OSDI 2024, §2).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

#: The metrics a goodput SLO may bound.
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured (seconds; ``itl`` one entry per gap between text chunks; ``start_s`` when it was
    actually sent, after the start of the run, ``None`` if never sent; ``response_id`` the stream's ``id``)."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list = field(default_factory=list)
    start_s: Optional[float] = 0.0
    response_id: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first, seconds; ``None`` with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation (numpy's default); ``None`` for
    no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def parse_goodput(items, flag: str = "--goodput") -> dict:
    """``["ttft:2000", "tpot:300"]`` -> ``{"ttft": 2.0, "tpot": 0.3}`` (seconds); ``flag`` is the option the
    message names.

    Raises:
        ValueError: an unknown metric or a bad number.
    """
    slos = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = float("nan")
        if name not in SLO_METRICS or not value > 0 or math.isinf(value):
            raise ValueError(f"{flag} takes METRIC:MS with METRIC in {SLO_METRICS} and MS > 0, got {item!r}")
        slos[name] = value / 1000
    return slos


def _dist(values: list, prefix: str) -> dict:
    ms = [v * 1000 for v in values]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else None,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"p90_{prefix}_ms": percentile(ms, 90),
        f"p99_{prefix}_ms": percentile(ms, 99),
    }


def summarize(results: list[RequestResult], duration: float, slos: dict) -> dict:
    """Aggregate metrics of one run: counts, token totals, throughputs (per second over ``duration`` seconds),
    goodput under ``slos`` (``parse_goodput``'s dict; ``None`` without SLOs), and mean / median / p90 / p99 of TTFT,
    TPOT, ITL and e2e latency in ms."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def meets(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
        return all(values[k] <= v for k, v in slos.items())

    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
        "goodput": (sum(meets(r) for r in ok) / duration if duration > 0 else 0.0) if slos else None,
    }
    summary.update(_dist([r.ttft for r in ok], "ttft"))
    summary.update(_dist([r.tpot for r in ok if r.tpot is not None], "tpot"))
    summary.update(_dist([x for r in ok for x in r.itl], "itl"))
    summary.update(_dist([r.e2el for r in ok], "e2el"))
    return summary


def format_table(s: dict) -> str:
    """A ``summarize`` dict as an aligned text table."""
    def f(v, unit=""):
        return "n/a" if v is None else (f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [
        ("successful requests", f(s["completed"])),
        ("failed requests", f(s["failed"])),
        ("benchmark duration", f(s["duration_s"], " s")),
        ("input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("request throughput", f(s["request_throughput"], " req/s")),
        ("output token throughput", f(s["output_throughput"], " tok/s")),
    ]
    if s["goodput"] is not None:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in s["goodput_slos_ms"].items())
        rows.append((f"goodput ({slo})", f(s["goodput"], " req/s")))
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows.append((f"{name} mean / p50 / p90 / p99",
                     " / ".join(f(s[f"{q}_{key}_ms"]) for q in ("mean", "median", "p90", "p99")) + " ms"))
    if s.get("prefix_cache_hit_rate") is not None:
        rows.append(("server prefix cache hit rate",
                     f"{100 * s['prefix_cache_hit_rate']:.1f}% of {s['prefix_cache_queries']:.0f} prompt tokens"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
