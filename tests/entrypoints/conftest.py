"""Live servers on 127.0.0.1 (a free port), each in a background thread, started once per session."""

import asyncio
import re
import threading
import time

import httpx
import pytest

from kvserve.entrypoints.openai.api_server import build_server
from kvserve.entrypoints.openai.serving_options import ServingOptions


class LiveServer:
    """A ``KVServeServer`` run by uvicorn in a daemon thread (its own event loop); ``url`` once started."""

    def __init__(self, server_kwargs: dict = None, **engine_args):
        """``server_kwargs``: extra ``build_server`` arguments (``api_key``, ``metrics_auth``)."""
        self.server = build_server(engine_args, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                   **(server_kwargs or {}))
        self.llm = self.server.llm
        self.llm_model_name = self.server.config.app.state.served_model_name
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def start(self, timeout: float = 60.0) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "server did not stop"

    def metrics(self) -> dict:
        """``/metrics`` as ``{name{labels without model_name}: value}``, e.g. ``kvserve:num_requests_running``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("kvserve:"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r',?model_name="[^"]*"', "", key).replace("{}", "").replace("{,", "{")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll ``/metrics`` until nothing runs or waits and no KV block is used; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
                    and m["kvserve:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="session")
def server():
    """The main test server: 256 KV blocks, up to 32 running, max_model_len 256."""
    s = LiveServer(num_kv_blocks=256, max_num_seqs=32, max_model_len=256).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def auto_tool_server():
    """The main test server's twin with ``--enable-auto-tool-choice`` (the Hermes parser, from the fallback tool
    prompt): what the Responses and Messages tests' "auto" tool calls need."""
    s = LiveServer(num_kv_blocks=256, max_num_seqs=32, max_model_len=256,
                   server_kwargs={"options": ServingOptions(enable_auto_tool_choice=True)}).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def model_name(server):
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
