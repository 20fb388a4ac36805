"""Graceful drain (issue 41, vLLM's ``--shutdown-timeout``): after SIGTERM new requests get a 503 with
``Retry-After`` and ``/health`` a 503 while the streams in flight run on; inside the timeout every stream finishes
normally, past it every one ends with an error event and ``[DONE]``; the server exits (0) with every KV block
free. In-process servers get the signal through ``handle_exit`` (what uvicorn's handler calls); the last test sends
a real SIGTERM to ``kvserve serve``."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import assert_pool_clean
from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Stream(threading.Thread):
    """One streamed completion read to its end in a thread: ``events`` are its ``data:`` lines."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.events = url, []
        self.body = {"prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                     "stream": True}
        self.start()

    def run(self):
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.events.append(line)

    def chunks(self) -> list:
        return [json.loads(e[6:]) for e in self.events if e != "data: [DONE]"]


def _assert_refusing(url: str) -> str:
    """New requests are refused (503, ``Retry-After``), ``/health`` is a 503; returns its message."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["type"] == "server_shutdown"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 503  # not ready: the balancer sends no more
    return health.json()["error"]["message"]


def test_streams_in_flight_finish_inside_the_timeout():
    s = LiveServer(server_kwargs={"shutdown_timeout": 300}, num_kv_blocks=64, max_num_seqs=4,
                   max_model_len=512).start()
    streams = [Stream(s.url, 200) for _ in range(2)]
    _wait(lambda: all(st.events for st in streams), what="first tokens")
    s.server.handle_exit(signal.SIGTERM, None)
    assert s.server.drain_deadline is not None and not s.server.should_exit
    assert _assert_refusing(s.url) == "draining: finishing 2 in-flight requests; not accepting new ones"
    for st in streams:
        st.join(120)
        assert not st.is_alive()
        chunks = st.chunks()
        assert st.events[-1] == "data: [DONE]" and all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) == 200  # every token, one chunk each
    s.thread.join(60)  # the server shuts down by itself once nothing is in flight
    assert not s.thread.is_alive()
    assert_pool_clean(s.llm.engine)


def test_past_the_timeout_every_request_is_aborted_and_no_block_leaks():
    s = LiveServer(server_kwargs={"shutdown_timeout": 3}, num_kv_blocks=256, max_num_seqs=4,
                   max_model_len=2048).start()
    streams = [Stream(s.url, 2000) for _ in range(2)]  # far longer than the drain
    pending = {}

    def non_streamed():
        body = {"prompt": "Count slowly:", "max_tokens": 2000, "ignore_eos": True}
        pending["r"] = httpx.post(s.url + "/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=non_streamed, daemon=True)
    t.start()
    _wait(lambda: all(st.events for st in streams) and s.llm.num_streams == 3, what="three requests running")
    s.server.handle_exit(signal.SIGTERM, None)
    _assert_refusing(s.url)
    for st in streams:
        st.join(120)
        assert not st.is_alive()
        assert st.events[-1] == "data: [DONE]"
        assert "shutting down" in st.chunks()[-1]["error"]["message"]
        assert len(st.chunks()) < 2000
    t.join(120)
    assert pending["r"].status_code == 503 and pending["r"].headers["Retry-After"] == "1"
    s.thread.join(60)
    assert not s.thread.is_alive()
    assert_pool_clean(s.llm.engine)


def test_sigterm_with_shutdown_timeout_drains_and_exits_0(tmp_path):
    log_path = tmp_path / "server.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "0", "--num-kv-blocks", "32",
         "--max-model-len", "256", "--no-access-log", "--shutdown-timeout", "300"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        def port():
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
            return m and int(m.group(1))

        _wait(lambda: port() or proc.poll() is not None, timeout=120, what="server start")
        assert proc.poll() is None, log_path.read_text()
        st = Stream(f"http://127.0.0.1:{port()}", 100)
        _wait(lambda: st.events, what="first token")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()
        st.join(30)
        assert st.events[-1] == "data: [DONE]" and len(st.chunks()) == 100
        assert st.chunks()[-1]["choices"][0]["finish_reason"] == "length"
        assert "draining" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
