"""ShareGPT multi-round conversations as closed-loop sessions: ``kvserve bench serve --dataset
sharegpt-multiround`` and ``python -m benchmarks.ray_serve``.

The data (``../shared/data/sharegpt_multiround``, LMBenchmark's "sharegpt" scenario): ``warmup.json`` holds round 2
of 55 users, ``run.json`` their rounds 3..N; each row is ``{"input": str, "output_length": int}`` where ``input``
is every message up to the round's user turn joined by ``"\\n"`` (earlier answers included), so a user's round is an
exact string prefix of the same user's next round (``read_conversations`` matches rounds to users by that).

Rendering (``render_rounds``): round 1 of a user is the chat template's rendering of one user message holding the
round's ``input`` (via the server's ``POST /tokenize``, so the server's own tokenizer and template), its head the
rendering without the template's generation suffix; every later round appends to the head the tokens of the text
the round adds (the earlier answer and the new question, from the dataset, so the ids are the same run to run). A
round's prompt is that head followed by the template's generation suffix (``<|im_end|>\\n<|im_start|>assistant\\n`` for ChatML): each round's prompt without the suffix
is an exact token prefix of the next round's prompt, as a chat client's would be.

The closed loop itself (round k + 1 sent ``think_time`` seconds after round k's answer has ended) is
``kvserve.bench.serve.run_sessions``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kvserve.bench.workloads import LoadRequest, default_data_dir
from kvserve.extras import require

DATASET_DIR = "sharegpt_multiround"


@dataclass
class Conversation:
    """One user's rounds from the dataset.

    Attributes:
        user: the user's row in ``warmup.json`` (0-based).
        texts: each round's ``input`` (str), shortest first; each is a prefix of the next.
        output_lens: each round's ``output_length`` (tokens of the real answer, Llama-3.1 tokenizer).
    """

    user: int
    texts: list
    output_lens: list


def read_conversations(data_dir=None) -> list[Conversation]:
    """Every user of the dataset with its rounds in order (round 2 from ``warmup.json``, then the ``run.json`` rows
    that extend it). A round that does not extend the one before ends the user's conversation there.

    Raises:
        ValueError: a missing file or a row without ``input`` / ``output_length``.
    """
    base = Path(data_dir or default_data_dir()) / DATASET_DIR
    rows = {}
    for name in ("warmup.json", "run.json"):
        path = base / name
        if not path.exists():
            raise ValueError(f"data file not found: {str(path)!r}; pass --data-dir")
        rows[name] = json.loads(path.read_text(encoding="utf-8"))
        for i, r in enumerate(rows[name]):
            if not isinstance(r, dict) or not isinstance(r.get("input"), str) or not isinstance(
                    r.get("output_length"), int):
                raise ValueError(f"{path}: row {i} must be {{'input': str, 'output_length': int}}")
    users = [[(w["input"], w["output_length"])] for w in rows["warmup.json"]]
    by_start = sorted(range(len(users)), key=lambda u: -len(users[u][0][0]))  # longest warm-up first
    for r in rows["run.json"]:
        owner = next((u for u in by_start if r["input"].startswith(users[u][0][0])), None)
        if owner is not None:
            users[owner].append((r["input"], r["output_length"]))
    out = []
    for u, rounds in enumerate(users):
        rounds.sort(key=lambda x: len(x[0]))
        kept = rounds[:1]
        for text, n in rounds[1:]:
            if len(text) == len(kept[-1][0]):
                continue  # a repeated row
            if not text.startswith(kept[-1][0]):
                break
            kept.append((text, n))
        out.append(Conversation(u, [t for t, _ in kept], [n for _, n in kept]))
    return out


def server_tokenizer(base_url: str, model: Optional[str] = None, headers: Optional[dict] = None,
                     timeout: float = 60.0) -> Callable[[dict], list]:
    """``tokenize(body) -> token ids`` through the server's ``POST /tokenize`` (``body``: vLLM's
    ``{"prompt": ...}`` or ``{"messages": ...}`` shape; ``model`` is added).

    Raises (from the returned function):
        ValueError: the server refuses the body or cannot be reached.
    """
    httpx = require("httpx", "bench", "kvserve bench serve")

    client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def tokenize(body: dict) -> list:
        try:
            r = client.post("/tokenize", json={**({"model": model} if model else {}), **body})
        except httpx.HTTPError as e:
            raise ValueError(f"POST /tokenize at {base_url} failed: {e}") from None
        if r.status_code != 200:
            raise ValueError(f"POST /tokenize at {base_url}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["tokens"]

    return tokenize


def _user_turn(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}


def generation_suffix(tokenize: Callable[[dict], list]) -> list:
    """The chat template's tokens after a user message's content (ChatML: ``<|im_end|>\n<|im_start|>assistant\n``):
    the longest common tail of two rendered one-message conversations whose contents end differently.

    Raises:
        ValueError: the renderings share no tail (a template without an end-of-turn marker).
    """
    a, b = tokenize(_user_turn("Hello")), tokenize(_user_turn("Goodbye, world"))
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    if n == 0:
        raise ValueError("the chat template puts nothing after a user message; multi-round prompts need its "
                         "generation suffix")
    return a[len(a) - n:]


def render_rounds(texts: list, tokenize: Callable[[dict], list], suffix: list, max_input_len: Optional[int] = None,
                  max_rounds: Optional[int] = None) -> list:
    """Prompt token ids of a conversation's rounds (see the module docstring), stopping before the first round
    longer than ``max_input_len`` tokens and after ``max_rounds`` rounds."""
    out: list = []
    head: list = []
    for k, text in enumerate(texts):
        if max_rounds is not None and k >= max_rounds:
            break
        if k == 0:
            full = tokenize(_user_turn(text))
            if full[len(full) - len(suffix):] != suffix:
                raise ValueError(f"the chat template's rendering of a user turn does not end with {suffix}")
            head = full[:len(full) - len(suffix)]
        else:
            head = head + tokenize({"prompt": text[len(texts[k - 1]):], "add_special_tokens": False})
        if max_input_len is not None and len(head) + len(suffix) > max_input_len:
            break
        out.append(head + suffix)
    return out


def build_sessions(tokenize: Callable[[dict], list], num_users: int, data_dir=None, max_rounds: Optional[int] = None,
                   max_input_len: Optional[int] = None, output_len: Optional[int] = None,
                   min_rounds: int = 2, flags: Optional[dict] = None, shown_cap: Optional[int] = None) -> list:
    """The first ``num_users`` users (dataset order) with at least ``min_rounds`` rounds within ``max_input_len``
    prompt tokens, as ``LoadRequest`` lists (one per round, ``output_len`` tokens each, or the dataset's own answer
    length when ``None``); at most ``max_rounds`` rounds per user.

    ``flags``: the command-line names the error messages give for ``"users"``, ``"rounds"``, ``"input"`` and
    ``"output"``; default: ``kvserve bench serve``'s. ``shown_cap``: the prompt cap as the caller's flag gave it, for
    the messages (default: ``max_input_len``).

    Raises:
        ValueError: bad counts, or fewer such users than ``num_users`` (the message names the flags).
    """
    names = {"users": "--num-prompts", "rounds": "--max-rounds", "input": "--multiround-max-input-len",
             "output": "--multiround-output-len", **(flags or {})}
    if num_users < 1:
        raise ValueError(f"{names['users']} (users) must be >= 1, got {num_users}")
    if max_rounds is not None and max_rounds < min_rounds:
        raise ValueError(f"{names['rounds']} must be >= {min_rounds}, got {max_rounds}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"{names['output']} must be >= 1, got {output_len}")
    suffix = generation_suffix(tokenize)
    sessions = []
    for conv in read_conversations(data_dir):
        if len(conv.texts) < min_rounds:
            continue
        rounds = render_rounds(conv.texts, tokenize, suffix, max_input_len, max_rounds)
        if len(rounds) < min_rounds:
            continue
        sessions.append([LoadRequest(ids, output_len or conv.output_lens[k]) for k, ids in enumerate(rounds)])
        if len(sessions) == num_users:
            return sessions
    cap = max_input_len if shown_cap is None else shown_cap
    raise ValueError(f"only {len(sessions)} users of {DATASET_DIR} have {min_rounds}+ rounds within "
                     f"{names['input']} {cap} tokens; ask fewer ({names['users']}) or raise the cap")
