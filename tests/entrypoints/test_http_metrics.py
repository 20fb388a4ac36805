"""Metrics an on-call engineer alerts on (issue 41): requests by route, method and status (401 and 413 included),
latency per route, the process collectors and vLLM's request-phase histograms, scraped from a live server with
prometheus_client's own parser; the dashboard's error counts."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.limits import RequestLimits
from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]

KEY = "sk-metrics-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = LiveServer(server_kwargs={"api_key": KEY, "limits": RequestLimits(max_request_body_bytes=1024)},
                   num_kv_blocks=16, max_num_seqs=2, max_model_len=128).start()
    yield s
    s.stop()


def scrape(server) -> dict:
    """``{(sample name, frozenset(labels without model_name)): value}`` of ``/metrics``, parsed by prometheus_client."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def requests_total(m: dict, route: str, method: str, status: int) -> float:
    key = ("http_requests_total", frozenset({"route": route, "method": method, "status": str(status)}.items()))
    return m.get(key, 0.0)


def test_requests_by_route_method_and_status(server):
    before = scrape(server)
    post = lambda path, **kw: httpx.post(server.url + path, timeout=60, **kw)  # noqa: E731
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert post("/v1/completions", json=body, headers=AUTH).status_code == 200
    assert post("/v1/completions", json=body, headers=AUTH).status_code == 200
    assert post("/v1/completions", json=body).status_code == 401  # no key
    assert post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post("/v1/completions", json={"prompt": "x" * 2000}, headers=AUTH).status_code == 413
    assert post("/v1/completions", json={"prompt": "hi", "n": 0}, headers=AUTH).status_code == 400
    assert httpx.get(server.url + "/v1/models/nope", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(server.url + "/no/such/route", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    after = scrape(server)

    def delta(route, method, status):
        return requests_total(after, route, method, status) - requests_total(before, route, method, status)

    assert delta("/v1/completions", "POST", 200) == 2
    assert delta("/v1/completions", "POST", 401) == 1
    assert delta("/v1/chat/completions", "POST", 401) == 1
    assert delta("/v1/completions", "POST", 413) == 1
    assert delta("/v1/completions", "POST", 400) == 1
    assert delta("/v1/models/{model_id:path}", "GET", 404) == 1
    assert delta("other", "GET", 404) == 1  # never the raw path
    assert delta("/health", "GET", 200) == 1
    count = ("http_request_duration_seconds_count", frozenset({"route": "/v1/completions", "method": "POST"}.items()))
    assert after[count] - before.get(count, 0.0) == 5
    # the dashboard's error totals come from the same counts
    totals = server.llm.state_observer.http_totals()
    assert totals["http_4xx"] >= 6 and totals["http_5xx"] == 0


def test_process_collectors_and_request_phases(server):
    before = scrape(server)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    m = scrape(server)
    names = {name for name, _ in m}
    assert m[("process_resident_memory_bytes", frozenset())] > 10 * 2**20
    assert m[("process_open_fds", frozenset())] > 0 and ("process_cpu_seconds_total", frozenset()) in m
    assert "python_info" in names and "python_gc_collections_total" in names
    for phase in ("queue", "prefill", "decode", "inference"):
        key = (f"kvserve:request_{phase}_time_seconds_count", frozenset())
        assert m[key] - before.get(key, 0.0) == 2, phase
    decode_sum = ("kvserve:request_decode_time_seconds_sum", frozenset())
    assert m[decode_sum] > before.get(decode_sum, 0.0)  # 3 tokens after the first took some time
