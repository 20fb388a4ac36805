"""``bench serve`` reads the server's prefix-cache counters before and after a run and prints the hit rate."""

import pytest

from kvserve.bench.serve import parse_prefix_counters, prefix_hit_rate
from kvserve.metrics import format_table, summarize

PAGE = """# HELP kvserve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries_total counter
kvserve:prefix_cache_queries_total{model_name="m"} 1536.0
kvserve:prefix_cache_queries_created{model_name="m"} 1.7e9
kvserve:prefix_cache_hits_total{model_name="m"} 1152.0
kvserve:num_requests_running{model_name="m"} 0.0
"""


def test_parse_and_rate():
    assert parse_prefix_counters(PAGE) == (1536.0, 1152.0)
    assert parse_prefix_counters("kvserve:num_requests_running 0.0\n") is None
    r = prefix_hit_rate((512.0, 0.0), (1536.0, 1152.0))
    assert r == {"prefix_cache_queries": 1024.0, "prefix_cache_hit_rate": 1152 / 1024}
    assert prefix_hit_rate(None, (1.0, 1.0))["prefix_cache_hit_rate"] is None


def test_table_row():
    s = summarize([], 1.0, {})
    s.update(prefix_hit_rate((0.0, 0.0), (1000.0, 750.0)))
    assert "server prefix cache hit rate" in format_table(s) and "75.0% of 1000 prompt tokens" in format_table(s)
    s = summarize([], 1.0, {})
    s.update(prefix_hit_rate(None, None))
    assert "prefix cache" not in format_table(s)


def test_prefix_repetition_dataset():
    """vLLM's prefix_repetition: each prefix shared by num_prompts // num_prefixes requests (+1 for the first
    remainder ones), a fresh suffix each, shuffled, the same for the same seed."""
    import argparse

    from kvserve.bench.serve import add_args, build_requests
    from kvserve.bench.workloads import prefix_repetition

    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--dataset-name", "prefix_repetition", "--num-prompts", "7", "--prefix-repetition-prefix-len",
                         "20", "--prefix-repetition-suffix-len", "5", "--prefix-repetition-num-prefixes", "3",
                         "--prefix-repetition-output-len", "4"])
    reqs = build_requests(args)
    assert [len(r.prompt) for r in reqs] == [25] * 7 and {r.output_len for r in reqs} == {4}
    counts = sorted(sum(1 for r in reqs if r.prompt[:20] == q.prompt[:20]) for q in reqs)
    assert counts == [2, 2, 2, 2, 3, 3, 3]  # prefixes shared by 3, 2, 2 requests
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 7
    assert [r.prompt for r in build_requests(args)] == [r.prompt for r in reqs]
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition(2, 10, 5, 3, 4)
