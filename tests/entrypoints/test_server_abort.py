"""Clients that disconnect have their requests aborted and every KV block freed; SIGTERM exits cleanly with 0."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]

# Long enough that no machine finishes it between its first tokens and the abort (a disconnect or SIGTERM that
# lands in milliseconds): every test below waits for generated tokens before cutting the request off.
MAX_MODEL_LEN = 2048
LONG = {"prompt": "Count slowly:", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
SERVER_ARGS = {"num_kv_blocks": 160, "max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN}  # 2560 token slots


@pytest.fixture(scope="module")
def server():
    """A server of its own (the shared one's max_model_len 256 caps a request too short to be sure to outlast an
    abort)."""
    s = LiveServer(**SERVER_ARGS).start()
    yield s
    s.stop()


def _wait(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _aborted(server) -> float:
    return server.metrics().get('kvserve:request_success_total{finished_reason="abort"}', 0.0)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before, tokens_before = _aborted(server), server.metrics()["kvserve:generation_tokens_total"]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip((ln for ln in lines if ln.startswith("data:")), range(3))]
            assert len(got) == 3
            assert server.metrics()["kvserve:kv_cache_usage_perc"] > 0
        # leaving the block closes the connection mid-stream
    m = server.wait_idle()
    assert m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0
    assert _aborted(server) == before + 1
    assert m["kvserve:generation_tokens_total"] - tokens_before < LONG["max_tokens"]
    server.llm.engine.kv_cache_manager.check_integrity()


def test_disconnect_mid_non_stream_aborts_and_frees_blocks(server):
    before, tokens_before = _aborted(server), server.metrics()["kvserve:generation_tokens_total"]
    body = json.dumps(LONG).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    _wait(lambda: server.metrics()["kvserve:generation_tokens_total"] >= tokens_before + 3, what="tokens")
    sock.close()
    m = server.wait_idle()
    assert m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0
    assert m["kvserve:num_requests_waiting"] == 0
    assert _aborted(server) == before + 1
    assert m["kvserve:generation_tokens_total"] - tokens_before < LONG["max_tokens"]
    server.llm.engine.kv_cache_manager.check_integrity()


def test_sigterm_aborts_in_flight_and_exits_0(tmp_path):
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "0", "--num-kv-blocks",
         str(SERVER_ARGS["num_kv_blocks"]), "--max-model-len", str(MAX_MODEL_LEN), "--no-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        def port():
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", (tmp_path / "server.log").read_text())
            return m and int(m.group(1))

        _wait(lambda: port() or proc.poll() is not None, timeout=120, what="server start")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        url = f"http://127.0.0.1:{port()}"
        events = []
        first_token = threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        first_token.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_token.wait(60), "no token streamed"  # running, with LONG's ~2000 tokens still to come
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
        t.join(30)
        assert not t.is_alive()
        assert events[-1] == "data: [DONE]" and "shutting down" in events[-2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
