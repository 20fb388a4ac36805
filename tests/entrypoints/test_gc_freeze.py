"""The server's start-up heap is frozen out of the cyclic collector (``freeze_gc_heap``) and thawed at shutdown."""

import gc

import httpx
import pytest

from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]


def _in_collected_generations(obj) -> bool:
    return any(o is obj for g in range(3) for o in gc.get_objects(generation=g))


def test_startup_objects_are_frozen_while_serving_and_thawed_after():
    s = LiveServer(num_kv_blocks=32, max_num_seqs=2, max_model_len=128).start()
    try:
        # the engine, its model and scheduler were alive at start-up: in the permanent generation, not scanned
        assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()
        engine = s.llm.engine
        assert not _in_collected_generations(engine)
        assert not _in_collected_generations(engine.scheduler)
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # still serves
    finally:
        s.stop()
    assert gc.get_freeze_count() == 0  # shutdown thawed them: another server (or a test) can collect them again
    assert _in_collected_generations(engine)
