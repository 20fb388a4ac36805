"""The dashboard's state endpoint and page on the live test server, and ``DashboardHub`` without a model."""

import argparse
import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.entrypoints.dashboard import hub as dash
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

SECRET = "The secret launch code is zebra-4471. Repeat it back:"


def read_events(response, n):
    """The first ``n`` SSE ``data:`` payloads of a streamed response, parsed."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            out.append(json.loads(line[5:]))
            if len(out) == n:
                return out
    return out


@pytest.mark.real_model
@pytest.mark.server
def test_state_snapshot_json(server):
    r = httpx.get(server.url + "/v1/engine/state", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    snap = body["snapshot"]
    assert snap["version"] == 1 and isinstance(body["history"], list)
    kv = snap["kv"]
    assert kv["num_blocks"] == 256 and len(kv["blocks"]) == 256 and set(kv["blocks"]) <= set("fcus")
    assert kv["used_blocks"] == sum(ch in "us" for ch in kv["blocks"])
    assert kv["cached_blocks"] == kv["blocks"].count("c") == len(kv["cached_lru"])
    assert snap["engine"]["max_num_seqs"] == 32 and snap["engine"]["show_prompts"] is False


@pytest.mark.real_model
@pytest.mark.server
def test_state_stream_while_serving_hides_prompts(server, model_name):
    """SSE events arrive while a request runs (and while idle); the request shows up with its block table,
    its KV usage agrees with the pool string, and its prompt text appears nowhere."""
    done = threading.Event()

    def generate():
        httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": SECRET, "max_tokens": 48, "ignore_eos": True, "temperature": 0})
        done.set()

    t = threading.Thread(target=generate)
    t.start()
    seen_running = False
    with httpx.Client(timeout=60) as c, c.stream("GET", server.url + "/v1/engine/state?stream=true&hz=10") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        seqs = []
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            assert "zebra" not in line
            msg = json.loads(line[5:])
            snap = msg["snapshot"]
            seqs.append(snap["seq"])
            kv = snap["kv"]
            assert kv["used_blocks"] == sum(ch in "us" for ch in kv["blocks"])
            for req in snap["running"]:
                assert "prompt" not in req
                assert all(kv["blocks"][b] in "us" for b in req["block_table"])
                seen_running = True
            if done.is_set() and seen_running and len(seqs) > 3:
                break
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    t.join()
    assert seen_running
    server.wait_idle()
    assert not server.llm.state_observer.viewers  # the closed stream unsubscribed


@pytest.mark.real_model
@pytest.mark.server
def test_state_idle_stream_keeps_ticking(server):
    """With nothing to do the engine loop is woken about once a second while a viewer is subscribed."""
    server.wait_idle()
    with httpx.Client(timeout=30) as c, c.stream("GET", server.url + "/v1/engine/state",
                                                 headers={"accept": "text/event-stream"}) as r:
        events = read_events(r, 3)  # a stream that stopped ticking fails on the client's read timeout
    seqs = [e["snapshot"]["seq"] for e in events]
    assert len(events) == 3 and seqs == sorted(set(seqs))
    assert all(e["snapshot"]["num_running"] == e["snapshot"]["num_waiting"] == 0 for e in events)


@pytest.mark.real_model
@pytest.mark.server
@pytest.mark.parametrize("query", ["hz=0", "hz=11", "hz=abc", "hz=nan", "stream=maybe", "foo=1"])
def test_state_bad_query(server, query):
    r = httpx.get(server.url + "/v1/engine/state?" + query, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == query.split("=")[0]


@pytest.mark.real_model
@pytest.mark.server
def test_page_and_assets(server):
    r = httpx.get(server.url + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "/dashboard/dashboard.js" in r.text and "http" not in r.text.split("<body>")[0].replace("http-equiv", "")
    js = httpx.get(server.url + "/dashboard/dashboard.js", timeout=30)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "/v1/engine/state" in js.text
    assert httpx.get(server.url + "/dashboard/dashboard.css", timeout=30).headers["content-type"].startswith("text/css")
    assert httpx.get(server.url + "/dashboard/secrets.txt", timeout=30).status_code == 404
    for path in ("/dashboard", "/dashboard/dashboard.js"):  # HEAD, as every other GET route (no body)
        head = httpx.head(server.url + path, timeout=30)
        assert head.status_code == 200 and head.content == b""
    # not in the OpenAPI schema (docs/server.md documents them)
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    assert "/dashboard" not in paths and "/v1/engine/state" not in paths


@pytest.mark.real_model
@pytest.mark.server
def test_dashboard_off_has_no_routes(server):
    app = build_app(server.llm, "m", dashboard=False)
    paths = {getattr(r, "path", None) for r in app.routes}
    assert "/dashboard" not in paths and "/v1/engine/state" not in paths


def test_flags_and_loopback_default():
    p = argparse.ArgumentParser()
    dash.add_args(p)
    assert p.parse_args([]).dashboard is None and p.parse_args([]).dashboard_show_prompts is False
    assert p.parse_args(["--dashboard"]).dashboard is True
    assert p.parse_args(["--no-dashboard"]).dashboard is False
    assert p.parse_args(["--dashboard-show-prompts"]).dashboard_show_prompts is True
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"):
        assert dash.is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert not dash.is_loopback(host), host


# ------------------------------------------------------------------------------------------ the hub, model-free
class FakeLLM:
    def __init__(self):
        self.wakes = 0
        self.is_running = True
        self.state_observer = None
        self.on_wake = None  # what a woken engine loop does (a turn: ``hub.observe``), if anything

    def wake(self):
        self.wakes += 1
        if self.on_wake is not None:
            self.on_wake()


def fake_engine():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), 64, prompt="hello")
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    sched = SimpleNamespace(running=[r], waiting=[], num_running=1, num_waiting=0, loading_requests=[])
    stats = SimpleNamespace(prompt_tokens=5, generation_tokens=0, num_preemptions=0, prefix_cache_queries=5,
                            prefix_cache_hits=0, spec_decode=None)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64,
                                                              scheduling="continuous", scheduling_policy="fcfs"),
                             cache_config=SimpleNamespace(kv_disk_cache_dir=None))
    return SimpleNamespace(kv_cache_manager=kv, scheduler=sched, stats=stats, config=config, max_model_len=64,
                           speculator=None, kv_tier=None, kv_cache_stats=lambda: kv.stats([r]))


def test_hub_builds_nothing_without_viewers_and_keeps_one_slot_per_viewer(monkeypatch):
    async def run():
        llm, engine = FakeLLM(), fake_engine()
        hub = dash.DashboardHub(llm, "m")
        for i in range(50):
            hub.observe([], engine, 100.0 + i)
        assert hub.num_snapshots == 0 and len(hub.history.points) == 49  # history is kept, no snapshot built
        slow, fast = hub.subscribe(hz=1.0), hub.subscribe(hz=10.0)
        assert llm.wakes == 2  # the first snapshot comes at the next loop turn
        for i in range(30):
            hub.observe([], engine, 200.0 + i * 0.05)  # 20 turns per second
        assert hub.num_snapshots == 15  # at the fastest viewer's 10 Hz, not at every turn
        # the slow viewer never read: it holds only the newest snapshot, nothing queued
        assert slow.latest is fast.latest and slow.latest.data["seq"] == 15
        snap = await hub.next_snapshot(slow, timeout=1.0)
        assert snap.data["seq"] == 15 and slow.latest is None
        assert snap.data["kv"]["blocks"] == "uuffffff" and "prompt" not in snap.data["running"][0]
        hub.unsubscribe(slow)
        hub.unsubscribe(fast)
        hub.observe([], engine, 300.0)
        assert hub.num_snapshots == 15
        # an idle engine: a waiting viewer wakes the loop every IDLE_POKE_S until a loop turn brings a snapshot.
        # Counted, not timed: this fake loop turns only on the third poke
        monkeypatch.setattr(dash, "IDLE_POKE_S", 0.01)
        v = hub.subscribe(hz=10.0)
        pokes = llm.wakes

        def turn_on_third_poke():
            if llm.wakes - pokes == 3:
                hub.observe([], engine, 400.0)

        llm.on_wake = turn_on_third_poke
        snap = await hub.next_snapshot(v, timeout=600.0)
        assert snap.data["seq"] == 16 and llm.wakes - pokes == 3 and v.latest is None
        # a loop that never turns: None after the timeout; a stopped loop: None at once
        llm.on_wake = None
        assert await hub.next_snapshot(v, timeout=0.05) is None
        llm.is_running = False
        assert await hub.next_snapshot(v, timeout=600.0) is None and hub.num_snapshots == 16
        for _ in range(dash.MAX_VIEWERS - 1):
            hub.subscribe(hz=1.0)
        with pytest.raises(RuntimeError, match="viewers"):
            hub.subscribe(hz=1.0)

    asyncio.run(run())


def test_hub_show_prompts():
    llm, engine = FakeLLM(), fake_engine()
    hub = dash.DashboardHub(llm, "m", show_prompts=True)
    hub.subscribe(hz=10.0)
    hub.observe([], engine, 1.0)
    [v] = hub.viewers
    assert v.latest.data["running"][0]["prompt"] == "hello" and v.latest.data["engine"]["show_prompts"] is True


def test_hub_errors_never_reach_the_engine_loop(caplog):
    llm, engine = FakeLLM(), fake_engine()
    hub = dash.DashboardHub(llm, "m")
    hub.subscribe(hz=10.0)
    engine.kv_cache_manager = None  # a broken engine view
    hub.observe([], engine, 1.0)
    hub.observe([], engine, 2.0)
    assert sum("observing the engine failed" in r.message for r in caplog.records) == 1
