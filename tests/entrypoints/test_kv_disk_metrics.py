"""The disk tier's numbers in the dashboard snapshot and in the Prometheus exposition: model-free, exact."""

from types import SimpleNamespace

import pytest

from kvserve.core.block_pool import hash_block
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_disk_store import ENTRY_HEADER, DiskBlockStore
from kvserve.core.kv_disk_tier import KVDiskTier, LoadResult
from kvserve.engine.stats import EngineStats
from kvserve.entrypoints.dashboard.snapshot import build_snapshot, kv_tier_summary
from kvserve.entrypoints.openai.metrics import PrometheusStatLogger

PAYLOAD = 1024


def tier_with_traffic(tmp_path):
    """2 blocks written, 3 looked up, 2 loaded in one job of 0.02 s."""
    tier = KVDiskTier(DiskBlockStore(tmp_path, bytes(32), 10**6), PAYLOAD)
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(a, [5, 6, 7, 8])
    for h in (a, b):
        assert tier.wants(h)
        tier.save(h, [bytes(PAYLOAD)])
    tier.flush()
    tier.stats.lookups += 3
    tier.finish_load(LoadResult([bytes(PAYLOAD)] * 2, 0.01), 0.02)
    return tier


def test_snapshot_carries_the_tier_summary(tmp_path):
    tier = tier_with_traffic(tmp_path)
    entry = ENTRY_HEADER.size + 4 * 8 + PAYLOAD
    summary = kv_tier_summary(tier, num_loading=1)
    assert summary == {"lookups": 3, "hits": 2, "misses": 1, "hit_rate": 0.6667, "bad_entries": 0,
                       "bytes_read": 2 * PAYLOAD, "bytes_written": 2 * entry, "blocks_written": 2,
                       "writes_dropped": 0, "loads": 1, "mean_load_ms": 20.0, "write_enabled": True,
                       "bytes_on_disk": 2 * entry, "capacity_bytes": 10**6, "num_loading": 1}
    snap = build_snapshot(KVCacheManager(4, 4), [], [], kv_tier=summary)
    assert snap["kv_tier"] == summary
    assert build_snapshot(KVCacheManager(4, 4), [], [])["kv_tier"] is None
    tier.close()


def test_prometheus_exposes_the_tier(tmp_path):
    tier = tier_with_traffic(tmp_path)
    engine = SimpleNamespace(scheduler=SimpleNamespace(num_running=0, num_waiting=0),
                             kv_cache_stats=lambda: SimpleNamespace(usage=0.0), stats=EngineStats(), kv_tier=tier)
    logger = PrometheusStatLogger("m")
    logger.record([], engine, 0.0)
    logger.record([], engine, 1.0)  # nothing new: counted once
    text = logger.exposition().decode()
    entry = ENTRY_HEADER.size + 4 * 8 + PAYLOAD
    for line in ('kvserve:kv_disk_cache_queries_total{model_name="m"} 3.0',
                 'kvserve:kv_disk_cache_hits_total{model_name="m"} 2.0',
                 'kvserve:kv_disk_cache_bad_entries_total{model_name="m"} 0.0',
                 f'kvserve:kv_disk_cache_read_bytes_total{{model_name="m"}} {2.0 * PAYLOAD}',
                 f'kvserve:kv_disk_cache_written_bytes_total{{model_name="m"}} {2.0 * entry}',
                 'kvserve:kv_disk_cache_load_seconds_count{model_name="m"} 1.0',
                 'kvserve:kv_disk_cache_load_seconds_bucket{le="0.025",model_name="m"} 1.0',
                 'kvserve:kv_disk_cache_load_seconds_bucket{le="0.01",model_name="m"} 0.0',
                 f'kvserve:kv_disk_cache_usage_bytes{{model_name="m"}} {2.0 * entry}'):
        assert line in text, line
    tier.close()


@pytest.mark.real_model
@pytest.mark.server
def test_one_flag_turns_it_on_and_the_server_shows_it(tmp_path):
    """A server with only ``kv_disk_cache_dir`` set: the first request writes its blocks, a second server on the
    same directory (a restart) loads them; /metrics and /v1/engine/state show it; the answers are identical."""
    import httpx

    from tests.entrypoints.conftest import LiveServer

    prompt = list(range(1000, 1000 + 16 * 5 + 3))  # five full blocks and three tokens
    answers = []
    for run in range(2):
        server = LiveServer(num_kv_blocks=32, kv_disk_cache_dir=str(tmp_path)).start()
        try:
            body = {"model": server.llm_model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "logprobs": 1, "ignore_eos": True}
            choice = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]
            answers.append((choice["text"], choice["logprobs"]["token_logprobs"]))
            m = server.wait_idle(120)
            tier = httpx.get(server.url + "/v1/engine/state", timeout=30).json()["snapshot"]["kv_tier"]
            assert tier["lookups"] == 5 and m["kvserve:kv_disk_cache_queries_total"] == 5
            assert tier["hits"] == m["kvserve:kv_disk_cache_hits_total"] == (0 if run == 0 else 5)
            assert tier["write_enabled"] and tier["capacity_bytes"] > 0
            server.llm.engine.kv_tier.flush()
        finally:
            server.stop()
    assert answers[0] == answers[1]
