"""``bench serve`` reads the server's prefix-cache counters before and after a run and prints the hit rate."""

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
