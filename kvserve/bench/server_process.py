"""A ``kvserve serve`` child process that never outlives the command that started it.

``kvserve sim validate`` and ``python -m kvserve.bench.dashboard`` start a server as a subprocess and stop it in a
``finally`` block. A ``finally`` block does not run when the command is ended by a signal, though: Python's default
SIGTERM action ends the process at once, and nothing runs at SIGKILL. The server then lived on, holding its port,
its KV pool and a core. Two guards close that:

- ``tie_to_parent`` (a ``preexec_fn``): Linux sends the child SIGTERM when the thread that started it ends, however
  it ends (``prctl(PR_SET_PDEATHSIG)``, man 2 prctl); the server shuts down on SIGTERM as it always does;
- ``sigterm_as_exit``: while the command runs, SIGTERM raises ``SystemExit(143)`` (128 + 15, the shell's code for a
  process ended by SIGTERM), so its ``finally`` blocks stop the server and remove temporary files first.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from typing import Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up here, in the parent: the child between fork and exec calls it without touching the dynamic loader (whose
# lock another thread of the parent may have held at the fork)
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def tie_to_parent(parent_pid: int) -> None:
    """``preexec_fn`` for ``subprocess.Popen`` (bound to the parent's pid): runs in the child between fork and exec,
    and asks the kernel to send it SIGTERM when the parent thread ends. If the parent ended before this ran (the
    child was re-parented already), the child sends itself SIGTERM. Does nothing off Linux."""
    # the fork inherited the parent's Python handler (``sigterm_as_exit``): a SIGTERM caught here before the exec
    # would be dropped by it, so the default action (end the process) comes back first
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _prctl is None:
        return
    # a refused prctl (a sandbox that filters it) leaves the child untied: the parent's clean-up still stops it
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent is gone already: do not start at all
        os.kill(os.getpid(), signal.SIGTERM)


def popen_tied(cmd: list, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` with ``tie_to_parent``: the child gets SIGTERM when the calling thread
    ends (keep that thread alive as long as the child should live: call it from the main thread).

    Raises:
        OSError: as ``subprocess.Popen`` (the program cannot be started).
    """
    return subprocess.Popen(cmd, preexec_fn=functools.partial(tie_to_parent, os.getpid()), **kwargs)


def _raise_exit(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` in the main thread instead of ending the process
    at once, so ``finally`` blocks and context managers run (further SIGTERMs are ignored while they do); the
    previous handler is put back after. Off the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:  # a handler installed outside Python reads as None: the default then
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
