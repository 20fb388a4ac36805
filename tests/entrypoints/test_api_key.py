"""API keys: ``--api-key`` / ``KVSERVE_API_KEY`` guard every route but ``/health`` (``/metrics`` with
``--no-metrics-auth``), through the official ``openai`` client and raw HTTP."""

import argparse
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from kvserve.entrypoints.openai.api_server import api_key_from, bind_socket
from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]

KEY = "sk-kvserve-test-0123456789"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def keyed():
    s = LiveServer(server_kwargs={"api_key": KEY}, num_kv_blocks=64, max_num_seqs=4, max_model_len=128).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_open_metrics():
    s = LiveServer(server_kwargs={"api_key": KEY, "metrics_auth": False}, num_kv_blocks=32, max_num_seqs=2,
                   max_model_len=64).start()
    yield s
    s.stop()


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_with_the_key(keyed):
    client = _client(keyed, KEY)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text == " Paris."
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None


@pytest.mark.parametrize("key", ["wrong-key", KEY + "x", KEY[:-1], ""])
def test_openai_client_with_a_wrong_key_is_401(keyed, key):
    client = _client(keyed, key or "unused")
    with pytest.raises(openai.AuthenticationError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                            "param": None, "code": "invalid_api_key"}


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"), ("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"), ("HEAD", "/v1/models"),
    ("GET", "/v1/engine/state"),  # the dashboard's data (the dashboard is on: a loopback host)
])
def test_every_route_but_health_needs_the_key(keyed, method, path):
    url = keyed.url + path
    missing = httpx.request(method, url, json={} if method == "POST" else None, timeout=30)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    if method != "HEAD":
        err = missing.json()["error"]
        assert err["code"] == "invalid_api_key" and "didn't provide an API key" in err["message"]
    for header in ("Bearer nope", f"Basic {KEY}", KEY, f"Bearer {KEY} extra"):
        r = httpx.request(method, url, headers={"Authorization": header}, timeout=30)
        assert r.status_code == 401, header
    ok = httpx.request(method, url, headers={"Authorization": f"bearer {KEY}"}, timeout=30,
                       json={"prompt": "hi", "max_tokens": 1} if path == "/v1/completions" else None)
    assert ok.status_code != 401


def test_dashboard_page_files_are_open_and_its_data_needs_the_key(keyed):
    # A browser opening the page cannot send a header: the page's files (no engine data) load without the key,
    # then the page sends the key from /dashboard#key=... on its state requests.
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 200, path
    assert httpx.get(keyed.url + "/dashboard/secret.txt", timeout=30).status_code == 401  # only the page's files
    state = httpx.get(keyed.url + "/v1/engine/state", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert state.status_code == 200 and state.headers["content-type"].startswith("application/json")


def test_health_is_open(keyed):
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    assert httpx.head(keyed.url + "/health").status_code == 200


def test_routes_added_later_are_covered(keyed):
    """The key is checked in a middleware around the whole app, not per route: a route registered after start-up
    is guarded as well."""
    app = keyed.server.config.app

    @app.get("/late-route")
    async def late():
        return {"ok": True}

    assert httpx.get(keyed.url + "/late-route").status_code == 401
    assert httpx.get(keyed.url + "/late-route", headers={"Authorization": f"Bearer {KEY}"}).json() == {"ok": True}


def test_metrics_can_be_exempted(keyed_open_metrics):
    url = keyed_open_metrics.url
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401


def test_key_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert api_key_from(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key_from(argparse.Namespace(api_key="from-flag")) == "from-flag"
    monkeypatch.setenv("KVSERVE_API_KEY", "")
    assert api_key_from(argparse.Namespace(api_key=None)) is None
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        api_key_from(argparse.Namespace(api_key=""))


def test_serve_on_a_busy_port_fails_at_once_before_loading_the_model():
    busy = bind_socket("127.0.0.1", 0)
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            bind_socket("127.0.0.1", port)
        # the CLI: exit status 2 and one line, long before a model load (~15-20 s) could finish
        r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 2
        assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}")
        r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "0", "--api-key", ""],
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 2 and "--api-key must not be empty" in r.stderr
    finally:
        busy.close()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_bench_serve_with_the_key_from_the_flag_or_the_environment(keyed, tmp_path, capsys, monkeypatch):
    """``kvserve bench serve --api-key`` (or ``$KVSERVE_API_KEY``): every request succeeds and the ``/metrics``
    scrape (prefix-cache counters) is authorised too; without the key the run stops with a one-line error."""
    import json

    from kvserve.entrypoints.cli import main

    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = ["bench", "serve", "--base-url", keyed.url, "--num-prompts", "2", "--random-input-len", "8",
            "--random-output-len", "2", "--quiet"]
    for extra, env in ((["--api-key", KEY], None), ([], KEY)):
        if env is not None:
            monkeypatch.setenv("KVSERVE_API_KEY", env)
        out = tmp_path / "bench.json"
        assert main([*args, *extra, "--output-json", str(out)]) == 0, capsys.readouterr()
        data = json.loads(out.read_text())
        assert data["completed"] == 2 and data["failed"] == 0
        assert data["prefix_cache_queries"] > 0  # /metrics was read with the key
        assert KEY not in out.read_text()
    monkeypatch.delenv("KVSERVE_API_KEY")
    capsys.readouterr()
    assert main(args) == 2
    assert "401" in capsys.readouterr().err
    assert main([*args, "--api-key", ""]) == 2
