"""``kvserve generate`` end to end (in-process, real model)."""

import json

import pytest

from kvserve.entrypoints.cli import main


@pytest.mark.real_model
def test_generate_json_with_prompts_and_file(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a planet."}]}) + "\n"
                 + json.dumps({"prompt": "The capital of France is"}) + "\n")
    rc = main(["generate", "--prompts-file", str(f), "--max-tokens", "8", "--json", "--num-kv-blocks", "64"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in data["outputs"]] == ["Name a planet.", "The capital of France is"]
    assert all(1 <= len(o["token_ids"]) <= 8 for o in data["outputs"])
    s = data["summary"]
    assert s["requests"] == 2 and s["output_tokens"] == sum(len(o["token_ids"]) for o in data["outputs"])
    assert s["kv_blocks_total"] == 64 and 0 < s["peak_kv_blocks_used"] <= 64 and s["preemptions"] == 0


@pytest.mark.real_model
def test_generate_text_summary_and_static(capsys):
    rc = main(["generate", "--prompt", "Say hello.", "--prompt", "Name a fruit.", "--max-tokens", "6",
               "--scheduling", "static", "--no-progress", "--num-kv-blocks", "64"])
    assert rc == 0
    out = capsys.readouterr().out
    for key in ("output throughput", "mean TTFT / TPOT", "peak KV blocks", "KV waste", "naive reservation",
                "preemptions", "[0] Say hello.", "[1] Name a fruit."):
        assert key in out


def test_generate_bad_arguments_exit_2(capsys, tmp_path):
    assert main(["generate", "--prompt", "x", "--max-tokens", "0", "--num-kv-blocks", "8"]) == 2
    assert "error: --max-tokens: max_tokens must be an integer >= 1, got 0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    assert main(["generate", "--prompts-file", str(bad), "--num-kv-blocks", "8"]) == 2
    assert "line 1" in capsys.readouterr().err
