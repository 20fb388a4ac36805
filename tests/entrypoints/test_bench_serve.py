"""``kvserve bench serve`` against the live test server (a few short requests per dataset)."""

import argparse
import json

import pytest

from kvserve.bench.serve import add_args, arrival_times, build_requests, check_dataset_flags, check_loopback
from kvserve.bench.workloads import LoadRequest
from kvserve.metrics import parse_goodput
from kvserve.bench.workloads import default_data_dir
from kvserve.entrypoints.cli import main

NO_DATA = pytest.mark.skipif(not default_data_dir().exists(), reason="../shared/data not present")

KEYS = ["completed", "failed", "duration_s", "request_throughput", "output_throughput", "goodput"] + [
    f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("mean", "median", "p90", "p99")]


@pytest.mark.real_model
@pytest.mark.server
@pytest.mark.parametrize("extra", [
    ["--dataset", "random", "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "inf"],
    pytest.param(["--dataset", "sharegpt", "--sharegpt-output-len", "4", "--sharegpt-max-chars", "300",
                  "--request-rate", "20", "--max-concurrency", "2"], marks=NO_DATA),
    pytest.param(["--dataset", "azure", "--length-scale", "32", "--max-input-len", "128", "--max-output-len", "6",
                  "--time-scale", "0.001"], marks=NO_DATA),
], ids=["random-inf", "sharegpt-rate20", "azure"])
def test_bench_serve_writes_metrics(server, tmp_path, capsys, extra):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--goodput", "ttft:60000",
               "tpot:60000", "--output-json", str(out), *extra])
    assert rc == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    for key in KEYS:
        assert key in data, key
    assert data["completed"] == 4 and data["failed"] == 0 and data["total_output_tokens"] >= 4
    assert data["mean_ttft_ms"] > 0 and data["p99_e2el_ms"] >= data["median_e2el_ms"] > 0
    assert data["request_throughput"] > 0 and 0 < data["goodput"] <= data["request_throughput"]
    assert len(data["requests"]) == 4
    table = capsys.readouterr().out
    assert "TTFT mean / p50 / p90 / p99" in table and "goodput" in table
    server.wait_idle()


def test_bench_serve_refuses_non_loopback_and_bad_args(capsys):
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    for url in ("http://10.1.2.3:8000", "http://8.8.8.8", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            check_loopback(url)
    assert main(["bench", "serve", "--base-url", "http://192.168.0.1:8000"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in (["ttft"], ["foo:1"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_bench_serve_refuses_a_flag_its_dataset_does_not_read(capsys):
    """``--max-output-len`` / ``--max-input-len`` cap only the azure trace: with another dataset a 2 naming the flag,
    the dataset it applies to and the dataset's own output-length flag, before any request."""
    assert main(["bench", "serve", "--dataset-name", "sharegpt", "--max-output-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "--max-output-len applies only to --dataset-name azure, not sharegpt" in err
    assert "use --sharegpt-output-len" in err
    for dataset, own in (("random", "--random-output-len"), ("sharegpt-multiround", "--multiround-output-len"),
                         ("prefix_repetition", "--prefix-repetition-output-len")):
        assert main(["bench", "serve", "--dataset-name", dataset, "--max-output-len", "32"]) == 2
        assert own in capsys.readouterr().err
    assert main(["bench", "serve", "--dataset-name", "random", "--max-input-len", "32"]) == 2
    assert "--max-input-len applies only to --dataset-name azure" in capsys.readouterr().err
    args = argparse.ArgumentParser()
    add_args(args)
    check_dataset_flags(args.parse_args(["--dataset-name", "azure", "--max-output-len", "6"]))  # azure reads it
    reqs = build_requests(args.parse_args(["--dataset-name", "random", "--num-prompts", "2"]))  # defaults: fine
    assert [r.output_len for r in reqs] == [16, 16]


def test_arrival_times():
    reqs = [LoadRequest("x", 1) for _ in range(2000)]
    assert arrival_times(reqs[:3], float("inf"), 0) == [0.0, 0.0, 0.0]
    times = arrival_times(reqs, 4.0, 0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 0.25) < 0.03
    assert arrival_times([LoadRequest("x", 1, 2.5)], 1.0, 0) == [2.5]
    with pytest.raises(ValueError):
        arrival_times(reqs, 0.0, 0)
