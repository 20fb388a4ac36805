"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` package, installed here with apt-get
when missing) driven by Playwright, against a live server with concurrent requests. Saves ``docs/dashboard.png``
(with ``KVSERVE_UPDATE_SCREENSHOTS=1``; else the temp folder).

Skipped, with the reason, only when Chromium is missing and cannot be installed (no apt-get, not root, or the
install fails). ``playwright install`` is never run: it would download a browser build of its own.
"""

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
NUM_BLOCKS = 128  # the test server's pool: small enough to read cell by cell
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The screenshots of docs/server.md are refreshed with KVSERVE_UPDATE_SCREENSHOTS=1; otherwise they go to the temp folder, so
# a test run leaves the work tree clean.
SCREENSHOT = (Path(__file__).resolve().parents[2] / "docs" if os.environ.get("KVSERVE_UPDATE_SCREENSHOTS") == "1"
              else Path(tempfile.gettempdir())) / "dashboard.png"
SYSTEM = ("You are a concise assistant for a small hardware store. Answer in one or two sentences, mention a "
          "product when it helps, and never invent prices. The store sells hand tools, power tools, paint, "
          "brushes, glue, screws, nails, wall plugs, sandpaper, sealant, plumbing parts, electrical cable, "
          "garden tools and cleaning products. Opening hours are eight to six on weekdays and nine to four on "
          "Saturdays. If a question is about safety, always advise the customer to switch off the power first. ")
QUESTIONS = ["How do I fix a squeaky door hinge?", "Which glue works on ceramic?", "What size drill bit for a "
             "6 mm wall plug?", "How do I stop a tap from dripping?", "Can I paint over wallpaper?",
             "How do I hang a heavy mirror on drywall?", "What is the best way to clean a paintbrush?",
             "Which sandpaper grit should I use on pine?", "How do I seal a gap around a bathtub?",
             "How do I cut a ceramic tile without a wet saw?", "Why does my extension cord feel warm?",
             "How do I remove rust from garden tools?"]


def _install_chromium() -> str:
    """Path of Chromium, installing Debian's package when missing; ``pytest.skip`` when that is impossible."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip("Chromium is not installed and apt-get is not available to install it")
    if os.geteuid() != 0:
        pytest.skip("Chromium is not installed and installing it with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"could not install Chromium: {' '.join(cmd)}: {e}")
        if p.returncode != 0:
            pytest.skip(f"could not install Chromium: {' '.join(cmd)} exited {p.returncode}: {p.stderr[-500:]}")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"apt-get installed chromium but {CHROMIUM} is missing")
    return CHROMIUM


@pytest.fixture(scope="module")
def chromium():
    return _install_chromium()


@pytest.fixture(scope="module")
def dash_server():
    """A server with a pool of NUM_BLOCKS blocks, 8 running at most."""
    s = LiveServer(num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_model_len=512).start()  # loopback: dashboard on
    yield s
    s.stop()


@pytest.fixture
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (a dev dependency)")
    with sync_api.sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=FLAGS,
                                                   viewport={"width": 1440, "height": 980})
        try:
            yield ctx
        finally:
            ctx.close()


def _send_requests(url: str, errors: list, stop: threading.Event) -> threading.Thread:
    """Chat-like completions in the background until ``stop`` is set: 12 clients, started 0.15 s apart, each sending
    one request after another (48-112 tokens each, so several run at once); the odd clients share a system prompt
    (prefix). The traffic lasts as long as the test watches it, however fast the machine is."""
    def one(i):
        time.sleep(0.15 * i)
        prompt = (SYSTEM if i % 2 else "") + "Question: " + QUESTIONS[i] + "\nAnswer:"
        n = 0
        while not stop.is_set():
            try:
                r = httpx.post(url + "/v1/completions", timeout=300, json={
                    "prompt": prompt, "max_tokens": 48 + 16 * ((i + n) % 5), "ignore_eos": True,
                    "temperature": 0.7, "seed": i + 100 * n})
                if r.status_code != 200:
                    errors.append(r.text)
            except Exception as e:  # noqa: BLE001 (reported by the test)
                errors.append(repr(e))
            n += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    waiter = threading.Thread(target=lambda: [t.join() for t in threads])
    waiter.start()
    return waiter


# Read in one go, inside the page, from one rendered snapshot: the counts the page shows and its cells.
DOM_STATE = """() => {
  const grid = document.getElementById('pool-grid');
  const cells = [...grid.querySelectorAll('.cell')];
  const rows = [...document.querySelectorAll('#running-body tr.req')].map(tr => ({
    id: tr.dataset.rid, blocks: tr.dataset.blocks ? tr.dataset.blocks.split(' ').map(Number) : []}));
  return {seq: +grid.dataset.seq, numBlocks: +grid.dataset.numBlocks, usage: +grid.dataset.usage,
          usedBlocks: +grid.dataset.usedBlocks, mode: grid.dataset.mode,
          states: cells.map(c => c.dataset.state || 'f').join(''), rows,
          waiting: document.querySelectorAll('#waiting-body tr.req').length};
}"""


# Every class the stream indicator takes, with whether a snapshot had arrived by then (set before the page's script)
CONN_LOG = """window.addEventListener('DOMContentLoaded', () => {
  window.connLog = [];
  const conn = document.getElementById('conn');
  new MutationObserver(() => window.connLog.push([conn.className,
      !!(window.kvDashboard && window.kvDashboard.lastEventAt != null)])).observe(conn, {attributes: true});
});"""

# The running table's last column ("accept") against its panel's right edge, and whether the panel scrolls
ACCEPT_FITS = """() => {
  const panel = document.getElementById('sched-panel');
  const th = [...panel.querySelectorAll('table.queue th')].find(e => e.textContent === 'accept');
  return {thRight: th.getBoundingClientRect().right, panelRight: panel.getBoundingClientRect().right,
          scroll: panel.scrollWidth, client: panel.clientWidth};
}"""


def test_dashboard_in_chromium(dash_server, browser):
    url = dash_server.url
    page = browser.new_page()
    page_errors = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    page.add_init_script(CONN_LOG)
    page.goto(url + "/dashboard")
    page.wait_for_function(f"() => document.querySelectorAll('#pool-grid .cell').length === {NUM_BLOCKS}",
                           timeout=30_000)
    assert page.eval_on_selector("#conn", "e => e.className") == "conn on"
    log = page.evaluate("window.connLog")  # amber "waiting" once connected, green only once a snapshot arrived
    assert log[0] == ["conn wait", False] and ["conn on", True] in log and ["conn on", False] not in log, log
    assert "waiting" not in page.inner_text("#pool-summary")

    second = browser.new_page()  # a second viewer at the same time
    second.goto(url + "/dashboard")
    second.wait_for_function("() => window.kvDashboard && window.kvDashboard.renders > 0", timeout=30_000)
    hub = dash_server.llm.state_observer
    assert len(hub.viewers) == 2

    errors: list = []
    stop = threading.Event()
    waiter = _send_requests(url, errors, stop)
    # the grid and the queues show the traffic
    page.wait_for_function("""() => document.querySelectorAll('#running-body tr.req').length >= 4
        && document.querySelectorAll('#pool-grid .cell.s-u, #pool-grid .cell.s-s').length > 8""", timeout=120_000)
    second.close()  # a viewer that goes away mid-run
    page.set_viewport_size({"width": 1400, "height": 980})  # the running table's last column is not clipped
    page.wait_for_timeout(200)
    fit = page.evaluate(ACCEPT_FITS)
    assert fit["thRight"] <= fit["panelRight"] and fit["scroll"] <= fit["client"], fit
    page.set_viewport_size({"width": 1440, "height": 980})
    deadline = time.monotonic() + 10
    while len(hub.viewers) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(hub.viewers) == 1

    # cells in use == kv_cache_usage_perc x blocks of the same snapshot; every block of every listed request's
    # table is a cell in use; a finished request's cells turn free or cached (unless reused by a later request)
    watched = None
    checks = 0
    shot = False
    deadline = time.monotonic() + 300
    while waiter.is_alive():
        if (checks >= 5 and watched is not None and watched.get("done") and shot) or time.monotonic() > deadline:
            stop.set()  # seen enough: the clients finish the requests they are in, then stop
        s = page.evaluate(DOM_STATE)
        used_cells = sum(ch in "us" for ch in s["states"])
        assert s["mode"] == "cells" and s["numBlocks"] == NUM_BLOCKS
        assert used_cells == round(s["usage"] * s["numBlocks"]) == s["usedBlocks"], s
        table_blocks = {b for r in s["rows"] for b in r["blocks"]}
        assert all(s["states"][b] in "us" for b in table_blocks), s
        assert len(table_blocks) == used_cells  # every block in use belongs to a listed request
        checks += 1
        ids = {r["id"] for r in s["rows"]}
        if watched is None and s["rows"]:
            watched = s["rows"][0]
        elif watched is not None and watched["id"] not in ids and "done" not in watched:
            freed = [b for b in watched["blocks"] if b not in table_blocks]
            assert freed and all(s["states"][b] in "fc" for b in freed), (watched, s)
            watched["done"] = True
        if not shot and len(s["rows"]) >= 6 and "c" in s["states"] and "s" in s["states"]:
            page.wait_for_timeout(300)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            shot = True
        page.wait_for_timeout(150)
    assert not errors, errors[:3]
    assert checks >= 5 and watched is not None and watched.get("done"), watched

    # all finished: the page and /metrics agree that nothing is in use; the prefix blocks stay cached
    m = dash_server.wait_idle()
    assert m["kvserve:kv_cache_usage_perc"] == 0
    page.wait_for_function("() => !document.querySelector('#running-body tr.req') "
                           "&& +document.getElementById('pool-grid').dataset.usedBlocks === 0", timeout=30_000)
    s = page.evaluate(DOM_STATE)
    assert set(s["states"]) <= set("fc") and "c" in s["states"]
    if not shot:
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 20_000
    assert not page_errors, page_errors


def test_before_the_first_snapshot_the_page_says_it_waits(dash_server, browser):
    """No snapshot (the state stream refused): the page says it waits for the first step, and the dot is red, never
    green."""
    page = browser.new_page()
    page.route("**/v1/engine/state*", lambda route: route.abort())
    page.goto(dash_server.url + "/dashboard")
    page.wait_for_function("() => document.getElementById('conn-text').textContent.startsWith('disconnected')",
                           timeout=30_000)
    assert page.eval_on_selector("#conn", "e => e.className") == "conn off"
    assert page.inner_text("#pool-summary") == "waiting for the first engine step…"
    assert page.evaluate("window.kvDashboard.renders") == 0
    page.close()


def test_hover_highlights_block_table(dash_server, browser):
    page = browser.new_page()
    page.goto(dash_server.url + "/dashboard")
    page.wait_for_function("() => window.kvDashboard && window.kvDashboard.renders > 0", timeout=30_000)
    done = threading.Event()

    def run():
        httpx.post(dash_server.url + "/v1/completions", timeout=300,
                   json={"prompt": SYSTEM + "Question: " + QUESTIONS[0], "max_tokens": 64, "ignore_eos": True})
        done.set()

    threading.Thread(target=run).start()
    page.wait_for_selector("#running-body tr.req", timeout=60_000)
    page.hover("#running-body tr.req")
    page.wait_for_function("() => document.getElementById('pool-grid').classList.contains('dim')", timeout=5_000)
    hl = page.evaluate("""() => {
        const row = document.querySelector('#running-body tr.req');
        const want = row.dataset.blocks.split(' ').map(Number).sort((a, b) => a - b);
        const got = [...document.querySelectorAll('#pool-grid .cell.hl')].map(c => +c.dataset.b).sort((a, b) => a - b);
        return {want, got, live: !!document.querySelector('#running-body tr.req')};
    }""")
    if hl["live"]:
        assert hl["got"] == hl["want"] and hl["got"], hl
    cell = page.query_selector("#pool-grid .cell.hl")
    if cell is not None:
        cell.hover()
        assert "block" in page.inner_text("#tip")
    done.wait(120)


def test_density_strip_at_50000_blocks(browser):
    """A 50,000-block pool (a synthetic snapshot, no server: the page's requests are answered by Playwright) is
    drawn on a canvas, a few pixels per block; saves ``docs/dashboard_density.png`` (the pool panel)."""
    import json
    from importlib import resources

    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.entrypoints.dashboard.snapshot import build_snapshot
    from kvserve.request import Request, RequestStatus
    from kvserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=50_000, block_size=16)
    prefix = list(range(100_000, 100_000 + 16 * 400))  # a 400-block shared prefix
    running = []
    for i in range(48):
        r = Request(f"cmpl-{i:04d}", prefix + [i] * (16 * (150 + 97 * (i % 11)) + 5), SamplingParams(max_tokens=512),
                    10**7, arrival_time=time.monotonic() - 30)
        hits = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, r.num_tokens - 16 * len(hits), hits) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        kv.cache_computed_blocks(r)
        running.append(r)
    for r in running[::3]:  # finished: their own blocks stay cached, evictable
        kv.free(r)
    running = [r for r in running if r.request_id in kv.req_to_blocks]
    snap = build_snapshot(kv, running, [], seq=1, engine_info={
        "model": "synthetic", "max_num_seqs": 64, "max_num_batched_tokens": 512, "scheduling": "continuous",
        "scheduling_policy": "fcfs", "enable_prefix_caching": True, "num_speculative_tokens": 0,
        "max_model_len": 32768, "show_prompts": False})
    event = b"event: state\ndata: " + json.dumps({"snapshot": snap, "history": []}).encode() + b"\n\n"
    static = resources.files("kvserve.entrypoints.dashboard").joinpath("static")
    types = {"html": "text/html", "js": "text/javascript", "css": "text/css"}

    def handle(route):
        path = route.request.url.split("kvserve.test", 1)[1].split("?")[0]
        if path == "/v1/engine/state":
            return route.fulfill(status=200, body=event, headers={"content-type": "text/event-stream"})
        name = "dashboard.html" if path == "/dashboard" else path.rsplit("/", 1)[-1]
        route.fulfill(status=200, body=static.joinpath(name).read_bytes(),
                      headers={"content-type": types[name.rsplit(".", 1)[1]]})

    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("http://kvserve.test/**", handle)
    page.goto("http://kvserve.test/dashboard")
    page.wait_for_function("() => document.getElementById('pool-grid').dataset.mode === 'density'", timeout=30_000)
    s = page.evaluate(DOM_STATE)
    assert s["numBlocks"] == 50_000 and s["usedBlocks"] == snap["kv"]["used_blocks"] > 15_000
    assert s["states"] == ""  # no per-block elements at this size
    assert page.evaluate("() => document.getElementById('density-canvas').width") > 0
    assert "cached" in page.inner_text("#lru-text")
    page.wait_for_timeout(200)
    page.locator("#pool-panel").screenshot(path=str(SCREENSHOT.with_name("dashboard_density.png")))
    box = page.locator("#density-canvas").bounding_box()
    assert box["height"] > 100  # one small cell per block, wrapped in rows
    page.mouse.move(box["x"] + 3, box["y"] + 3)  # block 0: the shared prefix
    page.wait_for_timeout(100)
    assert "shared prefix" in page.inner_text("#tip") and "ref_cnt" in page.inner_text("#tip")
    page.hover("#running-body tr.req")  # highlights that request's blocks
    page.wait_for_timeout(100)
    assert not errors, errors
