"""Rank 0 of a tensor-parallel engine: starts the worker processes, ships each step plan to them, runs its own
shard and samples on the gathered logits.

``TensorParallelExecutor`` has ``ModelRunner``'s call (``execute_model(plan) -> ModelRunnerOutput``), so the engine
step is unchanged: the scheduler runs once, here, and its plan goes to ranks 1 .. T-1 (``torch.multiprocessing``
spawn, one pipe each) before rank 0 runs the same forward through its own ``ModelRunner`` (whose model is rank 0's
shard, returning the full logits after the LM head's gather). A worker that dies or hangs makes rank 0's next
collective fail (at once, or after ``timeout_s``): the executor then raises a ``RuntimeError`` naming the rank and
stays failed; workers are stopped on ``shutdown()``, when the executor is garbage collected, or at exit.
"""

from __future__ import annotations

import logging
import time
import weakref
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.parallel_state import CollectiveError, TensorParallelGroup
from kvserve.distributed.worker import ShardSpec, forward_plan, worker_main, worker_plan
from kvserve.model.base import CausalLM
from kvserve.sample.sampler import Sampler
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# After a failed collective, how long to wait for the dead worker's exit to become visible (seconds).
_EXIT_GRACE_S = 2.0
# How long shutdown waits for a worker to leave on its own before terminating it (seconds).
_JOIN_S = 5.0


class TensorParallelExecutor:
    """Rank 0: the worker processes plus rank 0's own ``ModelRunner``.

    Args:
        model: rank 0's shard (built with ``spec.group(0)``'s backends).
        sampler: the ``Sampler`` (sampling runs on rank 0 only).
        spec: the ``ShardSpec`` every rank builds from.
        group: rank 0's ``TensorParallelGroup`` (the one ``model`` calls); joined here.

    Raises:
        RuntimeError: a worker failed to start (its traceback in the message), or start-up exceeded
            ``spec.timeout_s``; the started workers are stopped first.
    """

    def __init__(self, model: CausalLM, sampler: Sampler, spec: ShardSpec, group: TensorParallelGroup):
        self.spec, self.group = spec, group
        self.error: RuntimeError | None = None
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, group)
        for rank in range(1, spec.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), name=f"kvserve-tp-rank{rank}",
                               daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._wait_ready()
            group.init(spec.port, spec.device)
        except BaseException:
            self.shutdown()
            raise
        self.runner = ModelRunner(model, spec.num_blocks, spec.block_size, sampler, device=spec.device,
                                  kv_cache_dtype=getattr(torch, spec.kv_cache_dtype))
        logger.info("tensor parallel: %d ranks (workers pids %s), %s backend", spec.world_size,
                    [p.pid for p in self.procs], torch.distributed.get_backend())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        pending = dict(enumerate(self.conns, start=1))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel workers (ranks {sorted(pending)}) did not start within "
                                   f"{self.spec.timeout_s:g} s (distributed_timeout_seconds)")
            for conn in wait(list(pending.values()), timeout=min(left, 0.5)):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    kind, detail = conn.recv()
                except EOFError:  # it died before reporting
                    self.procs[rank - 1].join(_EXIT_GRACE_S)
                    raise RuntimeError(self._describe_rank(rank, "failed to start")) from None
                if kind != "ready":
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")
                del pending[rank]

    # ------------------------------------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """``ModelRunner.execute_model`` over all ranks: ship the plan, run rank 0's shard, sample here.

        Raises:
            RuntimeError: a worker died, failed or did not answer within ``timeout_s`` (naming its rank), now or
                in an earlier step (the executor stays failed: restart the engine).
        """
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        self._ship(scheduler_output)
        try:
            return self.runner.execute_model(scheduler_output)
        except CollectiveError as e:
            raise self._fail(e) from e

    def compute_logits(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """The plan's forward on all ranks without sampling: float32 ``[S, vocab_size]`` logits of the rows that
        would be sampled (tests and diagnostics; it writes K/V into the plan's blocks like a step).

        Raises:
            RuntimeError: as ``execute_model``.
        """
        self._ship(scheduler_output)
        try:
            return forward_plan(self.runner.model, self.runner.kv_cache, scheduler_output, self.spec.block_size,
                                self.spec.device)
        except CollectiveError as e:
            raise self._fail(e) from e

    def _ship(self, plan: SchedulerOutput) -> None:
        if self.error is not None:
            raise self.error
        message = worker_plan(plan)
        for conn in self.conns:
            try:
                conn.send(message)
            except OSError as e:  # the worker's end is closed: it died
                raise self._fail(e) from e

    # ------------------------------------------------------------------------------------------------ failures
    def _describe_rank(self, rank: int, what: str) -> str:
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        detail = ""
        try:
            while conn.poll():
                kind, text = conn.recv()
                if kind == "error":
                    detail = f":\n{text}"
        except (EOFError, OSError):
            pass
        code = proc.exitcode
        state = f"exited with code {code}" if code is not None else "is alive"
        if code is not None and code < 0:
            state += f" (signal {-code})"
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {what}: it {state}{detail}"

    def _fail(self, cause: BaseException) -> RuntimeError:
        """Name the rank(s) at fault, stop the workers, and remember the error for every later call."""
        deadline = time.monotonic() + _EXIT_GRACE_S
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.05)
        dead = [r for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        if dead:
            msg = "; ".join(self._describe_rank(r, "died") for r in dead)
        else:
            msg = (f"tensor-parallel worker rank(s) {list(range(1, self.spec.world_size))} did not answer within "
                   f"{self.spec.timeout_s:g} s (distributed_timeout_seconds)")
        self.error = RuntimeError(f"{msg}; the engine cannot continue ({cause})")
        logger.error("%s", self.error)
        self.shutdown()
        return self.error

    def shutdown(self) -> None:
        """Stop the workers (a clean exit, else terminate after a few seconds) and leave the group; idempotent."""
        self._finalizer()


def _stop_workers(procs: list, conns: list, group: TensorParallelGroup) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + _JOIN_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    group.destroy()
