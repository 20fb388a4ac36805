"""The tensor-parallel process group: start-up and the two collectives the sharded model calls, each bounded by a
timeout.

``torch.distributed`` with the gloo backend for CPU tensors (nccl for CUDA tensors, once kvserve has a GPU
backend), in the default process group: one tensor-parallel engine per process at a time (``destroy`` ends it so
another can start). Every collective is issued asynchronously and waited for with ``timeout``, so a rank that dies
or hangs makes the others raise ``CollectiveError`` instead of blocking forever (a dead peer usually fails the
operation at once, when its sockets close; a hung one after ``timeout``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died or hung). Attributes: ``op``, the collective's name."""

    def __init__(self, op: str, cause: BaseException):
        super().__init__(f"tensor-parallel {op} failed: {cause}")
        self.op = op


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick), for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    """``"nccl"`` for CUDA tensors, ``"gloo"`` otherwise (CPU)."""
    return "nccl" if device.startswith("cuda") else "gloo"


@dataclass
class TensorParallelGroup:
    """One rank's view of the group (implements ``kvserve.layers.linear.ParallelGroup``).

    Attributes:
        rank: this process's rank, ``0 .. world_size - 1`` (0 runs the engine: scheduler and sampling).
        world_size: ranks in the group (``tensor_parallel_size``).
        timeout: bound on ``init`` and on every collective.
    """

    rank: int
    world_size: int
    timeout: timedelta

    def init(self, port: int, device: str = "cpu") -> None:
        """Join the group (blocks until all ``world_size`` ranks have joined, at most ``timeout``).

        Raises:
            RuntimeError: a default process group already exists in this process (one tensor-parallel engine per
                process), or the rendezvous failed / timed out.
        """
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process; kvserve runs "
                               "one tensor-parallel engine per process (shut the other one down first)")
        dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=self.timeout)

    def _wait(self, op: str, work) -> None:
        try:
            if not work.wait(self.timeout):
                raise TimeoutError(f"not completed within {self.timeout.total_seconds():g} s")
        except (RuntimeError, TimeoutError) as e:
            raise CollectiveError(op, e) from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape, contiguous) over the ranks, in place; returns it.

        Raises:
            CollectiveError: a peer died or did not join within ``timeout``.
        """
        try:
            work = dist.all_reduce(x, async_op=True)
        except RuntimeError as e:
            raise CollectiveError("all_reduce", e) from e
        self._wait("all_reduce", work)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank 0: every rank's ``x`` (same shape on each) concatenated along ``dim`` in rank order; other ranks:
        ``x`` itself (sent to rank 0).

        Raises:
            CollectiveError: as ``all_reduce``.
        """
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            work = dist.gather(x, parts, dst=0, async_op=True)
        except RuntimeError as e:
            raise CollectiveError("gather", e) from e
        self._wait("gather", work)
        return torch.cat(parts, dim=dim) if self.rank == 0 else x

    @staticmethod
    def destroy() -> None:
        """Leave the group (no-op when none exists); a later ``init`` may start a new one."""
        if dist.is_initialized():
            dist.destroy_process_group()
