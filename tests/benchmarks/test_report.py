"""``python -m benchmarks.report --quick`` end to end on the real model: files written, numbers sane."""

import json

import pytest
import torch

from benchmarks.report import QUICK
from benchmarks.report import main

pytestmark = pytest.mark.real_model

PNGS = ("kv_memory.png", "batch_occupancy.png", "itl_chunked_prefill.png", "throughput_latency.png")


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quick_report_writes_plots_markdown_and_sane_json(tmp_path, capsys, restore_threads):
    out = tmp_path / "report"
    assert main(["--quick", "--num-threads", "1", "--out", str(out)]) == 0
    assert "p99 ITL" in capsys.readouterr().out

    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert all(f"]({name})" in md for name in PNGS)
    s = json.loads((out / "report.json").read_text())
    assert s["quick"] and s["files"] == list(PNGS)

    kv = s["kv"]
    assert 0 <= kv["paged_waste"] < 1 and 0 <= kv["naive_waste"] < 1
    assert 0 < kv["peak_stored_tokens"] <= min(kv["peak_allocated_tokens"], kv["peak_naive_reserved_tokens"])
    for run in kv["runs"].values():  # both policies generate every requested token
        assert run["output_tokens"] == kv["output_tokens"] and run["output_tokens_per_s"] > 0
        assert 1 <= run["mean_batch_size"] <= QUICK.kv_max_num_seqs
    assert kv["runs"]["continuous"]["steps"] <= kv["runs"]["static"]["steps"]

    itl = s["itl"]
    n_out = QUICK.itl_num_short * QUICK.itl_short_output + len(QUICK.itl_long_at_steps) * QUICK.itl_long_output
    for mode in ("chunked", "unchunked"):
        r = itl[mode]
        assert r["output_tokens"] == n_out
        assert 0 < r["p50_itl_s"] <= r["p99_itl_s"] <= r["max_stall_s"]
        assert r["long_ttft_s"] > 0 and r["output_tokens_per_s"] > 0
    assert itl["chunked"]["max_step_tokens"] <= QUICK.itl_chunk_budget  # the budget held every step
    assert itl["unchunked"]["max_step_tokens"] >= QUICK.itl_long_prompt  # the long prompt went in one step
    assert itl["p99_itl_ratio"] > 0 and itl["throughput_ratio"] > 0

    points = s["sweep"]["points"]
    assert len(points) == 1 + len(QUICK.sweep_fractions) and points[0]["rate_req_s"] is None
    for p in points:
        lo, hi = QUICK.sweep_output
        assert lo * p["num_requests"] <= p["output_tokens"] <= hi * p["num_requests"]
        assert 0 < p["p50_ttft_s"] <= p["p99_ttft_s"] and 0 < p["p50_tpot_s"] <= p["p99_tpot_s"]
