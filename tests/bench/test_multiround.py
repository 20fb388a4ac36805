"""``kvserve bench serve --dataset sharegpt-multiround``: the dataset's conversations, and the closed loop against a
live in-process server (2 users, tiny outputs)."""

import json
from collections import defaultdict

import httpx
import pytest

from kvserve.bench.multiround import read_conversations
from kvserve.bench.workloads import default_data_dir
from kvserve.entrypoints.cli import main

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not (default_data_dir() / "sharegpt_multiround").is_dir(),
                       reason="../shared/data/sharegpt_multiround not present"),
]

CAP = 400  # prompt tokens


def test_conversations_extend_each_other():
    convs = read_conversations()
    assert len(convs) == 55 and [c.user for c in convs] == list(range(55))
    assert sum(len(c.texts) for c in convs) == 55 + 252  # every run.json row found its user
    assert max(len(c.texts) for c in convs) == 11  # "up to 11 rounds/user" (../shared/data/sharegpt_multiround/README.txt)
    for c in convs:
        assert len(c.texts) == len(c.output_lens) >= 4  # users with >= 5 human turns: rounds 2..5 at least
        for a, b in zip(c.texts, c.texts[1:]):
            assert b.startswith(a) and len(b) > len(a)


@pytest.fixture(scope="module")
def server():
    from tests.entrypoints.conftest import LiveServer

    s = LiveServer(num_kv_blocks=128, max_num_seqs=8, max_model_len=512).start()
    yield s
    s.stop()


def test_closed_loop_rounds(server, tmp_path, capsys):
    out = tmp_path / "mr.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", "sharegpt-multiround", "--num-prompts", "2",
               "--max-rounds", "3", "--multiround-max-input-len", str(CAP), "--multiround-output-len", "2",
               "--think-time", "0.05", "--ignore-eos", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr()
    assert "server prefix cache hit rate" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["num_conversations"] == 2 and data["failed"] == 0
    convs = defaultdict(list)
    for r in data["requests"]:
        convs[r["conversation"]].append(r)
    assert sorted(convs) == [0, 1]

    def tokenize(body):
        return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]

    suffix = tokenize({"prompt": "<|im_end|>\n<|im_start|>assistant\n", "add_special_tokens": False})
    assert len(suffix) == 6  # <|im_end|> \n <|im_start|> assist ant \n: ChatML's generation suffix
    dataset = [c for c in read_conversations()]
    expected_hits = 0
    for rounds in convs.values():
        assert [r["round"] for r in rounds] == list(range(len(rounds))) and 2 <= len(rounds) <= 3
        assert all(r["output_tokens"] == 2 and r["output_len"] == 2 for r in rounds)
        assert all(len(r["prompt_token_ids"]) <= CAP for r in rounds)
        # round 1 is the chat template's rendering of the user's first dataset input
        first = rounds[0]["prompt_token_ids"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": first}, timeout=30).json()["prompt"]
        conv = next(c for c in dataset if text.endswith(f"user\n{c.texts[0]}<|im_end|>\n<|im_start|>assistant\n"))
        assert tokenize({"messages": [{"role": "user", "content": conv.texts[0]}]}) == first
        if len(rounds) < 3:  # the cap dropped the user's later rounds
            assert len(conv.texts) > len(rounds)
        for a, b in zip(rounds, rounds[1:]):
            assert b["start_s"] >= a["start_s"] + a["e2el"] + 0.05  # sent after the answer ended + think time
            head = a["prompt_token_ids"][:-len(suffix)]
            assert a["prompt_token_ids"][-len(suffix):] == suffix and b["prompt_token_ids"][:len(head)] == head
            assert len(b["prompt_token_ids"]) > len(a["prompt_token_ids"])
            expected_hits += len(head) // 16 * 16  # the previous round's full blocks
    hits = data["prefix_cache_hit_rate"] * data["prefix_cache_queries"]
    queries = sum(r["prompt_tokens"] for r in data["requests"])
    assert data["prefix_cache_queries"] == queries
    p0, p1 = (convs[i][0]["prompt_token_ids"] for i in (0, 1))
    common = next(i for i, (x, y) in enumerate(zip(p0, p1)) if x != y) // 16 * 16  # the system prompt's blocks
    assert expected_hits <= round(hits) <= expected_hits + common
    server.wait_idle()


def test_bad_multiround_flags(server, capsys):
    base = ["bench", "serve", "--base-url", server.url, "--dataset", "sharegpt-multiround"]
    for extra, field in ((["--max-rounds", "1"], "--max-rounds"), (["--think-time", "-1"], "--think-time"),
                         (["--multiround-max-input-len", "20"], "--multiround-max-input-len"),
                         (["--multiround-output-len", "0"], "--multiround-output-len")):
        assert main(base + extra) == 2
        assert field in capsys.readouterr().err


def test_session_errors_name_the_callers_flags(server):
    """``python -m benchmarks.ray_serve`` passes its own flag names and its cap as given (the longest
    prompt allowed, one more than the rounds' cap without the generation suffix)."""
    from kvserve.bench.multiround import build_sessions, server_tokenizer

    flags = {"users": "--num-users", "rounds": "--rounds", "input": "--max-input-tokens", "output": "--output-len"}
    tokenize = server_tokenizer(server.url)
    for kwargs, message in (({"num_users": 0}, "--num-users (users) must be >= 1, got 0"),
                            ({"num_users": 3, "max_rounds": 1}, "--rounds must be >= 2, got 1"),
                            ({"num_users": 3, "output_len": 0}, "--output-len must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build_sessions(tokenize, flags=flags, **kwargs)
    with pytest.raises(ValueError, match=r"only \d+ users of sharegpt_multiround have 2\+ rounds within "
                                         r"--max-input-tokens 40 tokens; ask fewer \(--num-users\)"):
        build_sessions(tokenize, 50, max_input_len=39, flags=flags, shown_cap=40)
    with pytest.raises(ValueError, match=r"within --multiround-max-input-len 39 tokens; ask fewer \(--num-prompts\)"):
        build_sessions(tokenize, 50, max_input_len=39)
