"""A server started by a command never outlives it (``kvserve.bench.server_process``): the child is ended when its
parent dies, even by SIGKILL, and a SIGTERM runs the command's ``finally`` blocks (``kvserve sim validate`` stops its
server and removes its temporary step trace)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child whose parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_dead(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list:
    """Child pids of ``pid``, from /proc/PID/task/PID/children, or (kernels without it) every /proc/*/stat's ppid."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        pass
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_a_tied_child_gets_sigterm_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from kvserve.bench.server_process import popen_tied
        child = popen_tied(["sleep", "120"])
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()  # SIGKILL: no finally block, no handler runs in the parent
        parent.wait()
        assert _wait_dead(child, 10), "the child outlived its killed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_untied_child_would_outlive_its_parent():
    """The control: without the tie the same child lives on (so the test above shows the tie, not the kernel)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, time
        child = subprocess.Popen(["sleep", "120"])
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    try:
        assert not _wait_dead(child, 1.5)
    finally:
        os.kill(child, signal.SIGKILL)


def test_sigterm_runs_finally_blocks_and_exits_143_even_when_sent_twice(tmp_path):
    marker = tmp_path / "cleaned"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from kvserve.bench.server_process import sigterm_as_exit
        with sigterm_as_exit():
            try:
                print("ready", flush=True)
                time.sleep(120)
            finally:
                print("cleaning", flush=True)
                time.sleep(1.0)  # a clean-up that takes a while (stopping a server)
                open({str(marker)!r}, "w").write("done")
    """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "cleaning"
    proc.send_signal(signal.SIGTERM)  # impatient: ignored while the clean-up runs
    assert proc.wait(30) == 143
    assert marker.read_text() == "done"


def test_sigterm_handler_is_restored_after_the_block():
    from kvserve.bench.server_process import sigterm_as_exit

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_exit():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def _validate_with_its_server(tmp_path, healthy: bool) -> tuple:
    """Start a small ``kvserve sim validate`` (its files under ``tmp_path``); return ``(process, server pid)`` once
    its ``kvserve serve`` child exists (``healthy``: and answers ``/health``, and validate has had 2 s to see it)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "sim", "validate", "--profile",
           str(REPO / "docs" / "simulator_profile.json"), "--rates", "1", "--num-prompts", "4", "--num-kv-blocks", "64",
           "--max-num-seqs", "2", "--num-threads", "1", "--warmup-s", "60"]
    validate = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert validate.poll() is None, "sim validate ended before its server was up"
        for pid in _children(validate.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:  # gone already
                continue
            if b"serve" not in args or b"--port" not in args:
                continue
            if not healthy:
                return validate, pid
            try:
                port = int(args[args.index(b"--port") + 1])
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    time.sleep(2.0)  # validate polls /health every second: it is in its warm-up now
                    return validate, pid
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    validate.kill()
    raise AssertionError("no server within 240 s")


@pytest.mark.parametrize("healthy", [True, False], ids=["in-its-warm-up", "while-the-model-loads"])
def test_sim_validate_killed_by_sigterm_stops_its_server_and_removes_its_trace(tmp_path, healthy):
    validate, server = _validate_with_its_server(tmp_path, healthy)
    try:
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvserve-validate-")]
        validate.send_signal(signal.SIGTERM)
        assert validate.wait(90) == 143
        # validate stopped and reaped its server itself (no zombie left for PID 1 to reap)
        assert not Path(f"/proc/{server}").exists(), "the server outlived sim validate"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvserve-validate-")]  # its trace is removed
    finally:
        if validate.poll() is None:
            validate.kill()
        if _alive(server):
            os.kill(server, signal.SIGKILL)
