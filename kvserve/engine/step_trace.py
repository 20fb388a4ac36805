"""``kvserve serve --step-trace FILE``: one JSON line per engine step of a live server, for the simulator.

Each line is ``{"t0": s, "t1": s, "more": 0|1, "rows": [[q, start_pos, spec, logits], ...]}``: the
``time.monotonic()`` seconds at which ``AsyncLLM``'s loop handed the step to its worker thread and got it back,
whether requests were left unfinished after it (``more``: the loop goes on to the next step without idling), and
per scheduled request of the step's ``SchedulerOutput`` its query tokens ``q``, the position of its first one
(``start_pos``), whether it verifies drafts (``spec``: 0/1) and how many rows it samples (``logits``: sampling
states + draft tokens, 0 for a prompt chunk that does not end its prompt). After a step with ``more``, the time
from its ``t0`` to the next line's is the server's whole loop turn (step + streaming the outputs + admitting new
requests), which is what ``kvserve sim`` advances its clock by. ``kvserve sim validate`` reads these lines
(``kvserve.sim.trace.read_step_trace``) to compare the cost model with the server step by step
(``kvserve.sim.cost_model.row_features`` turns ``rows`` into the model's features).

Lines are buffered and written every ``flush_every`` steps and on ``close``; a write error stops the trace with a
warning rather than the server.
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)


def plan_rows(scheduler_output) -> list:
    """``[[q, start_pos, spec, logits], ...]`` of a ``SchedulerOutput``, one per scheduled request (tokens,
    position, 0/1, rows)."""
    rows = []
    for s in scheduler_output.scheduled:
        logits = len(s.sampling_states) + len(s.spec_token_ids) if s.samples else 0
        rows.append([len(s.token_ids), s.start_pos, 1 if s.spec_token_ids else 0, logits])
    return rows


class StepTrace:
    """Appends one line per step to ``path`` (created or truncated at start).

    Args:
        path: the JSONL file.
        flush_every: steps buffered between writes.

    Raises:
        ValueError: ``path`` cannot be opened for writing.
    """

    def __init__(self, path, flush_every: int = 64):
        try:
            self._f = open(path, "w")
        except OSError as e:
            raise ValueError(f"--step-trace: cannot write {str(path)!r} ({e.strerror})") from None
        self.path = path
        self.flush_every = flush_every
        self._buf: list = []

    def record(self, scheduler_output, t0: float, t1: float, more: bool = True) -> None:
        """Note a step that ran from ``t0`` to ``t1`` (monotonic seconds), after which requests were left unfinished
        iff ``more``; steps that scheduled nothing are left out."""
        if self._f is None or scheduler_output is None or not scheduler_output.scheduled:
            return
        line = {"t0": round(t0, 6), "t1": round(t1, 6), "more": int(more), "rows": plan_rows(scheduler_output)}
        self._buf.append(json.dumps(line, separators=(",", ":")))
        if len(self._buf) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._f is None or not self._buf:
            return
        try:
            self._f.write("\n".join(self._buf) + "\n")
            self._f.flush()
        except OSError as e:
            logger.warning("step trace %s stopped: %s", self.path, e)
            self._f = None
        self._buf.clear()

    def close(self) -> None:
        self.flush()
        if self._f is not None:
            self._f.close()
            self._f = None

