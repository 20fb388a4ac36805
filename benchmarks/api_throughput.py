"""``python -m benchmarks.api_throughput``: output-token throughput of Chat Completions, Responses and Anthropic
Messages at the same concurrency (64 streams by default), in one run on one server.

A server (``api_server.build_server`` with the engine flags, in a background thread of this process) gets, per
round and per API, ``--concurrency`` streamed requests at once: the same ``--concurrency`` distinct one-turn
conversations, greedy, ``--max-tokens`` each, so each API renders the same prompts and generates the same tokens
(a plain user message renders alike in all three). The client reads and parses every event. The APIs take turns
in a rotated order each round (``--rounds``), so drift in the machine's speed falls on all of them; the table gives
each API's output tokens/s (median and range over the rounds) and its ratio to Chat Completions' median, and the
process's CPU seconds per 1,000 output tokens (client, server and engine share this process: on a host loaded by
other work, CPU time moves far less than wall time, and the engine's share is the same for all APIs). Output
tokens come from each API's own usage report (chat: ``stream_options.include_usage``; Responses:
``response.completed``; Messages: ``message_delta``). Issue 48's target: Responses and Messages within 3%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import httpx

from benchmarks import engine_main

TOPICS = ["the sea", "a city at night", "a mountain", "an old library", "a train journey", "a garden", "the moon",
          "a market"]


def conversations(n: int) -> list:
    """``n`` distinct one-turn prompts."""
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}, version {i}." for i in range(n)]


def request_for(api: str, model: str, prompt: str, max_tokens: int) -> tuple:
    """``(path, body)`` of one streamed request of ``api``."""
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if api == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                 "temperature": 0, "stream": True, "store": False}
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True}


def output_tokens(api: str, event: dict) -> int:
    """The output-token count an event reports (0 for events without usage)."""
    if api == "chat":
        return (event.get("usage") or {}).get("completion_tokens", 0)
    if api == "responses":
        return event["response"]["usage"]["output_tokens"] if event.get("type") in (
            "response.completed", "response.incomplete") else 0
    return event["usage"]["output_tokens"] if event.get("type") == "message_delta" else 0


async def one(client: httpx.AsyncClient, api: str, model: str, prompt: str, max_tokens: int) -> int:
    path, body = request_for(api, model, prompt, max_tokens)
    n = 0
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += output_tokens(api, json.loads(line[6:]))
    return n


def cpu_seconds() -> float:
    """This process's user + system CPU time (all its threads: the engine's included)."""
    t = os.times()
    return t.user + t.system


async def run_round(base_url: str, api: str, model: str, prompts: list, max_tokens: int) -> tuple:
    """``(output tokens, wall seconds, CPU seconds)`` of all ``prompts`` at once on ``api``."""
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        t0, c0 = time.perf_counter(), cpu_seconds()
        counts = await asyncio.gather(*(one(client, api, model, p, max_tokens) for p in prompts))
        return sum(counts), time.perf_counter() - t0, cpu_seconds() - c0


APIS = ("chat", "responses", "messages")


def run(args, engine_args: dict) -> int:
    from kvserve.entrypoints.openai.api_server import build_server

    engine_args = {"max_num_seqs": args.concurrency, **engine_args}
    server = build_server(engine_args, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                          dashboard=False)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{server.port}"
    model = server.config.app.state.served_model_name
    prompts = conversations(args.concurrency)
    try:
        asyncio.run(run_round(base, "chat", model, prompts[:4], 4))  # warm-up
        rates: dict = {a: [] for a in APIS}
        cpu: dict = {a: [] for a in APIS}
        for r in range(args.rounds):
            order = APIS[r % 3:] + APIS[:r % 3]
            for api in order:
                tokens, seconds, cpu_s = asyncio.run(run_round(base, api, model, prompts, args.max_tokens))
                rates[api].append(tokens / seconds)
                cpu[api].append(1000 * cpu_s / tokens)
                print(f"round {r} {api:9s} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s, "
                      f"{1000 * cpu_s / tokens:.2f} CPU s per 1k tokens", flush=True)
    finally:
        server.should_exit = True
        thread.join(60)
    base_rate, base_cpu = statistics.median(rates["chat"]), statistics.median(cpu["chat"])
    print(f"\n| API ({args.concurrency} streams, {args.max_tokens} tokens each) | output tok/s median | range | "
          f"vs chat | CPU s / 1k tokens | vs chat |")
    print("|---|---:|---:|---:|---:|---:|")
    for api in APIS:
        med, c = statistics.median(rates[api]), statistics.median(cpu[api])
        print(f"| {api} | {med:.1f} | {min(rates[api]):.1f}-{max(rates[api]):.1f} | {med / base_rate:.3f} | "
              f"{c:.2f} | {c / base_cpu:.3f} |")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=64, help="streams at once per API (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the APIs take turns, rotated (default 3)")


if __name__ == "__main__":
    raise SystemExit(engine_main("api_throughput", __doc__, add_args, run, pass_engine_kwargs=True,
                                 skip=("max_num_seqs",)))
