"""``kvserve bench serve``: an async HTTP load generator against a running OpenAI-compatible server (modelled on
``vllm bench serve``).

Requests are streamed from ``/v1/completions`` (``stream_options.include_usage``). Arrivals: a Poisson process at
``--request-rate`` requests/s (``inf``: all at once), or, for ``--dataset-name azure``, the trace's own timestamps times
``--time-scale``; ``--max-concurrency`` caps requests in flight. ``--dataset-name sharegpt-multiround`` is closed-loop:
users arrive at ``--request-rate`` users/s and send their next round ``--think-time`` seconds after the previous
answer ended (``kvserve.bench.multiround``). Per request it measures, on the client:

- TTFT: send to the first chunk with text; ITL: gaps between later text chunks;
- TPOT: ``(e2e - TTFT) / (output tokens - 1)`` with the server's token count (usage);
- e2e latency: send to the last byte.

It reports mean / p50 / p90 / p99 of each (ms), request and output-token throughput, goodput (requests/s that
met every ``--goodput`` SLO), and the server's prefix-cache hit rate over the run (its ``/metrics`` counters read
before and after: a run that repeats an earlier run's prompts — the same ``--seed`` — starts on a warm cache, and
this shows it), prints a table and writes JSON (with every request's actual send offset, prompt token ids and
``max_tokens``, which ``kvserve sim --dataset bench`` replays in the simulator). It only talks to
loopback addresses, and is bounded in count (``--num-prompts`` <= 10000) and time (``--request-timeout`` per
request, ``--max-duration`` for the run).
Against a server started with ``--api-key``, pass the same key (``--api-key``, or ``$KVSERVE_API_KEY``): every
request carries it, ``/v1/models`` and the ``/metrics`` scrape included (the key is never written to the report).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import random
import re
import socket
import sys
import time
from dataclasses import asdict
from typing import Optional
from urllib.parse import urlparse

from kvserve.bench.workloads import LoadRequest, azure_trace, prefix_repetition, random_lengths, sharegpt_prompts
from kvserve.extras import require
from kvserve.metrics import RequestResult, format_table, parse_goodput, summarize

MAX_PROMPTS = 10_000


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback only; default: %(default)s)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--dataset-name", "--dataset", dest="dataset", choices=["random", "sharegpt", "azure", "sharegpt-multiround", "prefix_repetition"], default="random",
                   help="the prompts (default: %(default)s: random token ids, no data files needed)")
    p.add_argument("--num-prompts", type=int, default=20, help="requests (sharegpt-multiround: users)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of a Poisson process (sharegpt-multiround: users/s); inf = all at once "
                        "(ignored by --dataset azure)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=16)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: random tokens after the prefix")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: distinct prefixes, shared evenly by the requests")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: max_tokens")
    p.add_argument("--sharegpt-output-len", type=int, default=64, help="max_tokens for ShareGPT prompts")
    p.add_argument("--sharegpt-max-chars", type=int, default=4000, help="skip longer ShareGPT prompts")
    p.add_argument("--azure-kind", choices=["conv", "code"], default="conv")
    p.add_argument("--length-scale", type=float, default=8.0, help="azure: divide token counts by this")
    p.add_argument("--time-scale", type=float, default=1.0, help="azure: multiply arrival offsets by this")
    p.add_argument("--max-input-len", type=int, default=None,
                   help="azure: cap on prompt tokens (default: 512; another dataset refuses it)")
    p.add_argument("--max-output-len", type=int, default=None,
                   help="azure: cap on output tokens (default: 256; another dataset refuses it: its output length "
                        "flag is --random-output-len, --sharegpt-output-len, --prefix-repetition-output-len or "
                        "--multiround-output-len)")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="sharegpt-multiround: seconds between a round's answer and the user's next round")
    p.add_argument("--max-rounds", type=int, default=None, help="sharegpt-multiround: rounds per user (default all)")
    p.add_argument("--multiround-max-input-len", type=int, default=2048,
                   help="sharegpt-multiround: a user's rounds stop before the first prompt longer than this (tokens)")
    p.add_argument("--multiround-output-len", type=int, default=None,
                   help="sharegpt-multiround: max_tokens per round (default: the dataset's answer length)")
    p.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="generate exactly max_tokens, past EOS (default: off, as in vLLM; said in the output when on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:300 (metrics: ttft, tpot, e2el; milliseconds)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts and arrivals; the same seed sends the same prompts, which an earlier run may have "
                        "left in the server's prefix cache (see the printed hit rate)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--save-result", action="store_true",
                   help="write the results as JSON to --result-dir/--result-filename (vLLM's names)")
    p.add_argument("--result-dir", default=".", help="directory for --save-result (default: %(default)s)")
    p.add_argument("--result-filename", default=None,
                   help="file name for --save-result (default: kvserve-{rate}qps-{model}-{YYYYmmdd-HHMMSS}.json)")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="write the results to PATH (the same JSON as --save-result; kvserve's older name)")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    p.add_argument("--api-key", default=None,
                   help=f"key of a server started with --api-key, sent as a Bearer token on every request, "
                        f"/v1/models and /metrics included (default: ${API_KEY_ENV})")


# ------------------------------------------------------------------------------------------------ checks
#: The environment variable ``kvserve serve`` reads its key from; the benchmark reads the same one.
API_KEY_ENV = "KVSERVE_API_KEY"


def auth_headers(api_key: Optional[str]) -> dict:
    """``{"Authorization": "Bearer <key>"}`` for ``api_key`` (else ``$KVSERVE_API_KEY``), or ``{}`` when neither
    is set (a server without authentication).

    Raises:
        ValueError: ``--api-key ""``.
    """
    if api_key is not None and not api_key:
        raise ValueError("--api-key must not be empty")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def check_loopback(base_url: str) -> None:
    """Raises ``ValueError`` unless every address ``base_url``'s host resolves to is a loopback address."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--base-url must be http(s)://host:port, got {base_url!r}")
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {parsed.hostname!r}: {e}") from None
    addrs = {info[4][0] for info in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"kvserve bench serve only targets loopback servers; {parsed.hostname!r} is {sorted(addrs)}")


# ------------------------------------------------------------------------------------------------ workload
#: flags that only some datasets read: flag -> (those datasets, the default there); given with another dataset,
#: a flag is refused by name (``check_dataset_flags``) rather than silently ignored
DATASET_FLAGS = {"max_input_len": (("azure",), 512), "max_output_len": (("azure",), 256)}
#: each dataset's own output-length flag (what a refused ``--max-output-len`` points to)
OUTPUT_LEN_FLAGS = {"random": "--random-output-len", "sharegpt": "--sharegpt-output-len",
                    "prefix_repetition": "--prefix-repetition-output-len",
                    "sharegpt-multiround": "--multiround-output-len"}


def check_dataset_flags(args) -> None:
    """Refuse a dataset-specific flag (``DATASET_FLAGS``) given with a dataset that does not read it.

    Raises:
        ValueError: naming the flag, the datasets it applies to, and the dataset's own output-length flag.
    """
    for name, (datasets, _) in DATASET_FLAGS.items():
        if getattr(args, name) is not None and args.dataset not in datasets:
            flag = "--" + name.replace("_", "-")
            own = OUTPUT_LEN_FLAGS.get(args.dataset)
            hint = f"; use {own} for this dataset" if own and name == "max_output_len" else ""
            raise ValueError(f"{flag} applies only to --dataset-name {' or '.join(datasets)}, not "
                             f"{args.dataset}{hint}")


def _dataset_flag(args, name: str):
    """``args.<name>``, or its default (``DATASET_FLAGS``) when not given."""
    value = getattr(args, name)
    return DATASET_FLAGS[name][1] if value is None else value


def build_requests(args) -> list:
    """The ``LoadRequest`` list for ``args.dataset``.

    Raises:
        ValueError: bad counts, a missing data file, a flag this dataset does not read (``check_dataset_flags``).
    """
    check_dataset_flags(args)
    n = args.num_prompts
    if not 1 <= n <= MAX_PROMPTS:
        raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got {n}")
    if args.dataset == "random":
        reqs = random_lengths(n, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
        return [LoadRequest(r.prompt_token_ids, r.output_len) for r in reqs]
    if args.dataset == "prefix_repetition":
        reqs = prefix_repetition(n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                 args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed)
        return [LoadRequest(r.prompt_token_ids, r.output_len) for r in reqs]
    if args.dataset == "sharegpt":
        if args.sharegpt_output_len < 1:
            raise ValueError("--sharegpt-output-len must be >= 1")
        texts = sharegpt_prompts(n, args.seed, args.data_dir, max_chars=args.sharegpt_max_chars)
        return [LoadRequest(text, args.sharegpt_output_len) for text in texts]
    if args.time_scale < 0:
        raise ValueError("--time-scale must be >= 0")
    reqs = azure_trace(n, args.seed, args.data_dir, kind=args.azure_kind, scale=args.length_scale,
                       max_input_len=_dataset_flag(args, "max_input_len"),
                       max_output_len=_dataset_flag(args, "max_output_len"),
                       time_scale=args.time_scale)
    return [LoadRequest(r.prompt_token_ids, r.output_len, r.arrival_s) for r in reqs]


def multiround_sessions(args, model: str, headers: Optional[dict] = None) -> list:
    """``--dataset sharegpt-multiround``: one closed-loop session (a list of ``LoadRequest``, one per round) per
    user (``kvserve.bench.multiround``; prompts rendered through the server's ``/tokenize``, sent with
    ``headers``).

    Raises:
        ValueError: bad counts or caps, a missing data file, a server that cannot tokenize.
    """
    from kvserve.bench import multiround

    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got {args.num_prompts}")
    if not (args.think_time >= 0 and math.isfinite(args.think_time)):
        raise ValueError(f"--think-time must be >= 0 seconds, got {args.think_time}")
    if args.multiround_max_input_len < 1:
        raise ValueError(f"--multiround-max-input-len must be >= 1, got {args.multiround_max_input_len}")
    tokenize = multiround.server_tokenizer(args.base_url, model, headers)
    return multiround.build_sessions(tokenize, args.num_prompts, args.data_dir, args.max_rounds,
                                     args.multiround_max_input_len, args.multiround_output_len)


def request_records(sessions: list, results: list, multiround: bool = False) -> list:
    """One JSON-ready dict per request, in session order: what it measured (``RequestResult`` without ``itl``,
    ``start_s`` its actual send offset in s), ``tpot``, what was sent (``prompt_token_ids``, or ``prompt`` for
    text, and ``output_len`` = ``max_tokens``), and with ``multiround`` its ``conversation`` and ``round`` (0-based).
    ``kvserve.sim.trace.read_bench_records`` replays them."""
    out = []
    for i, (session, res) in enumerate(zip(sessions, results)):
        for k, (req, r) in enumerate(zip(session, res)):
            rec = {k2: v for k2, v in asdict(r).items() if k2 != "itl"} | {"tpot": r.tpot}
            rec["prompt_token_ids" if isinstance(req.prompt, list) else "prompt"] = req.prompt
            rec["output_len"] = req.output_len
            if multiround:
                rec.update(conversation=i, round=k)
            out.append(rec)
    return out


def result_paths(args: argparse.Namespace, model: str) -> list:
    """Where the report goes: ``--output-json`` and, with ``--save-result``, ``--result-dir`` /
    ``--result-filename`` (default ``kvserve-{rate}qps-{model}-{YYYYmmdd-HHMMSS}.json``, vLLM's pattern); the
    directory is created."""
    paths = [args.output_json] if args.output_json else []
    if args.save_result:
        name = args.result_filename or (f"kvserve-{args.request_rate}qps-{model.replace('/', '_')}-"
                                        f"{time.strftime('%Y%m%d-%H%M%S')}.json")
        os.makedirs(args.result_dir, exist_ok=True)
        paths.append(os.path.join(args.result_dir, name))
    return paths


def write_report(report: dict, path) -> None:
    """``report`` as indented JSON, each entry of its ``requests`` list on one line (token id lists stay short)."""
    head = {k: v for k, v in report.items() if k != "requests"}
    text = json.dumps(head, indent=2)
    if "requests" in report:
        rows = ",\n".join("    " + json.dumps(r) for r in report["requests"])
        text = (text[:-2] + ",\n" if head else "{\n") + f'  "requests": [\n{rows}\n  ]\n}}'
    with open(path, "w") as fh:
        fh.write(text + "\n")


def arrival_times(requests: list, rate: float, seed: int) -> list:
    """Send offsets (s): the requests' own ``arrival_s`` when set, else a Poisson process at ``rate`` req/s starting
    at 0 (all 0 for ``inf``).

    Raises:
        ValueError: ``rate`` not > 0.
    """
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(requests):
        if r.arrival_s is not None:
            out.append(r.arrival_s)
            continue
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ client
async def send_request(client, url: str, payload: dict, timeout: float) -> RequestResult:
    """POST one streaming completion and time it (``httpx.AsyncClient``); never raises for HTTP-level failures."""
    res = RequestResult()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_into(res, client, url, payload, start), timeout)
    except asyncio.TimeoutError:
        res.success, res.error = False, f"timed out after {timeout} s"
    except Exception as e:  # connection refused / reset: counted as a failed request
        res.success, res.error = False, f"{type(e).__name__}: {e}"
    res.e2el = time.perf_counter() - start
    if res.success and res.output_tokens == 0:
        res.success, res.error = False, "no usage chunk in the stream"
    return res


async def _stream_into(res: RequestResult, client, url: str, payload: dict, start: float) -> None:
    last = start
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res.success = not res.error
                return
            obj = json.loads(data)
            if not res.response_id and obj.get("id"):
                res.response_id = str(obj["id"])
            if "error" in obj:
                res.error = str(obj["error"].get("message", obj["error"]))
                continue
            if obj.get("usage"):
                res.prompt_tokens = obj["usage"]["prompt_tokens"]
                res.output_tokens = obj["usage"]["completion_tokens"]
            if any(c.get("text") for c in obj.get("choices", ())):
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now


async def run_benchmark(base_url: str, model: str, requests: list, offsets: list, **kwargs) -> tuple:
    """Send every request at its offset (open loop); returns ``(results, duration_s)``. Keyword arguments as
    ``run_sessions`` (``max_concurrency``, ``headers`` ...)."""
    results, duration = await run_sessions(base_url, model, [[r] for r in requests], offsets, **kwargs)
    return [r for session in results for r in session], duration


async def run_sessions(base_url: str, model: str, sessions: list, offsets: list, *, think_time: float = 0.0,
                       max_concurrency=None, ignore_eos: bool = True, temperature: float = 0.0,
                       request_timeout: float = 600.0, max_duration: float = 3600.0,
                       headers: Optional[dict] = None) -> tuple:
    """Closed-loop sessions: session ``i`` (a list of ``LoadRequest``, e.g. a conversation's rounds) sends its
    first request at ``offsets[i]`` seconds after the start and each next one ``think_time`` seconds after the
    previous one's response has ended; a failed request ends its session (the rest are not sent). ``headers`` go
    with every request (e.g. ``auth_headers``); ``max_concurrency`` caps requests in flight over all sessions.

    Returns ``(results, duration_s)``: ``results[i][k]`` the ``RequestResult`` of session ``i``'s request ``k``
    (``start_s``: its actual send offset). Requests unsent or running after ``max_duration`` are cancelled and count
    as failed, as do those never sent because an earlier one of their session failed.
    """
    httpx = require("httpx", "bench", "kvserve bench serve")

    url = base_url.rstrip("/") + "/v1/completions"
    limit = max_concurrency or max(1, len(sessions))
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    results: list = [[None] * len(s) for s in sessions]
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout, pool=None),
                                 headers=headers) as client:
        start = time.perf_counter()

        async def one(i: int, session: list, offset: float) -> None:
            delay = offset - (time.perf_counter() - start)
            for k, req in enumerate(session):
                if delay > 0:
                    await asyncio.sleep(delay)
                payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
                           "stream_options": {"include_usage": True}, "temperature": temperature,
                           "ignore_eos": ignore_eos}
                async with sem:
                    sent = time.perf_counter() - start
                    res = await send_request(client, url, payload, request_timeout)
                res.start_s = sent
                results[i][k] = res
                if not res.success:
                    return
                delay = think_time

        tasks = [asyncio.ensure_future(one(i, s, o)) for i, (s, o) in enumerate(zip(sessions, offsets))]
        pending: set = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max_duration)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    for session, task in zip(results, tasks):
        if task.cancelled():
            error = f"not finished within --max-duration {max_duration} s"
        elif task.exception() is not None:
            error = f"{type(task.exception()).__name__}: {task.exception()}"
        else:
            error = "not sent: an earlier request of its session failed"
        for k, r in enumerate(session):
            if r is None:
                session[k] = RequestResult(error=error, start_s=None)  # never sent
    return results, duration


# ------------------------------------------------------------------------------------------------ report
_PREFIX_COUNTER = re.compile(r"^kvserve:prefix_cache_(queries|hits)_total(?:\{[^}]*\})?\s+(\S+)\s*$")


def parse_prefix_counters(metrics_text: str) -> Optional[tuple]:
    """``(queries, hits)`` (prompt tokens) summed over the ``kvserve:prefix_cache_{queries,hits}_total`` series of a
    Prometheus text page, or ``None`` when the page has neither."""
    found = {"queries": 0.0, "hits": 0.0}
    seen = False
    for line in metrics_text.splitlines():
        m = _PREFIX_COUNTER.match(line)
        if m:
            found[m.group(1)] += float(m.group(2))
            seen = True
    return (found["queries"], found["hits"]) if seen else None


def fetch_prefix_counters(base_url: str, timeout: float = 10.0, headers: Optional[dict] = None) -> Optional[tuple]:
    """The server's prefix-cache counters from ``GET /metrics`` (``parse_prefix_counters``, sent with
    ``headers``); ``None`` if the server does not expose them or cannot be read (a wrong key included)."""
    httpx = require("httpx", "bench", "kvserve bench serve")

    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout, headers=headers)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_prefix_counters(r.text)


def prefix_hit_rate(before: Optional[tuple], after: Optional[tuple]) -> dict:
    """The server's prefix-cache hit rate over the run from counters read before and after it: prompt tokens
    found in the cache / looked up. A warm cache (prompts repeated from an earlier run with the same ``--seed``)
    shows here."""
    if before is None or after is None:
        return {"prefix_cache_queries": None, "prefix_cache_hit_rate": None}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prefix_cache_queries": queries, "prefix_cache_hit_rate": hits / queries if queries > 0 else 0.0}


def fetch_model(base_url: str, timeout: float = 10.0, headers: Optional[dict] = None) -> str:
    """The first model id of ``GET /v1/models`` (sent with ``headers``).

    Raises:
        ValueError: the server cannot be reached, refuses the key (401) or lists no model.
    """
    httpx = require("httpx", "bench", "kvserve bench serve")

    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout, headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list models at {base_url}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """``kvserve bench serve``: returns 0 when every request succeeded, 1 otherwise.

    Raises:
        ValueError: bad arguments, a non-loopback server, an unreachable server.
    """
    check_loopback(args.base_url)
    check_dataset_flags(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    slos = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not (args.request_timeout > 0 and args.max_duration > 0):
        raise ValueError("--request-timeout and --max-duration must be > 0")
    headers = auth_headers(getattr(args, "api_key", None))
    multi = args.dataset == "sharegpt-multiround"
    requests = None if multi else build_requests(args)
    model = args.model or fetch_model(args.base_url, headers=headers)
    sessions = multiround_sessions(args, model, headers) if multi else [[r] for r in requests]
    offsets = arrival_times([s[0] for s in sessions], args.request_rate, args.seed)
    counters_before = fetch_prefix_counters(args.base_url, headers=headers)
    results, duration = asyncio.run(run_sessions(
        args.base_url, model, sessions, offsets, think_time=args.think_time if multi else 0.0,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        request_timeout=args.request_timeout, max_duration=args.max_duration, headers=headers))
    summary = summarize([r for res in results for r in res], duration, slos)
    summary.update(prefix_hit_rate(counters_before, fetch_prefix_counters(args.base_url, headers=headers)))
    config = {k: getattr(args, k) for k in ("base_url", "dataset", "num_prompts", "request_rate", "max_concurrency",
                                            "random_input_len", "random_output_len", "random_range_ratio",
                                            "sharegpt_output_len", "time_scale", "ignore_eos", "temperature", "seed")}
    if multi:
        config.update({k: getattr(args, k) for k in ("think_time", "max_rounds", "multiround_max_input_len",
                                                     "multiround_output_len")})
        summary["num_conversations"] = len(sessions)
    config["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model, "config": config, **summary,
              "requests": request_records(sessions, results, multi)}
    if not args.quiet:
        if args.ignore_eos:
            print("ignore_eos: on (every request generates exactly its max_tokens, past EOS)")
        print(format_table(summary))
    for path in result_paths(args, model):
        write_report(report, path)
    if summary["failed"]:
        print(f"{summary['failed']} requests failed: {summary['errors']}", file=sys.stderr)
        return 1
    return 0
