"""A tensor-parallel worker process (ranks 1 .. T-1): builds its shard of the model and of the KV pool, then runs
every step plan rank 0 sends it.

The scheduler runs once, on rank 0, which sends each step's plan (a ``SchedulerOutput``, stripped of what only
sampling reads) through a pipe; every rank builds the same flat batch from it (``build_step_batch``: the same block
ids on every rank, each rank holding its own KV heads of each block) and runs the same forward, meeting the others
in its all-reduces and the LM head's gather. Workers never sample: rank 0 does, on the gathered logits.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from kvserve.config import KernelConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.distributed.parallel_state import TensorParallelGroup
from kvserve.model.base import CausalLM
from kvserve.batch import build_step_batch
from kvserve.worker.kv_pool import new_kv_pool


@dataclass(frozen=True)
class ShardSpec:
    """What a rank needs to build its shard; the same for every rank (picklable: sent to spawned workers).

    Attributes:
        model: the resolved model path (a ``.gguf`` file or a Hugging Face directory).
        dtype: ``"float32"`` / ``"bfloat16"``.
        quantization: the resolved linear method (``"auto"``, ``"fp32"``, ``"int8"``).
        device: ``"cpu"``.
        num_threads: torch threads per rank (``None``: torch's default, i.e. ``OMP_NUM_THREADS``).
        num_blocks, block_size: the KV pool geometry, the same on every rank (rank 0 sizes it).
        world_size: ``tensor_parallel_size``.
        timeout_s: bound on start-up and on every collective, seconds.
        port: the rendezvous port on 127.0.0.1.
        kv_cache_dtype: the pool's element type, ``"float32"`` / ``"bfloat16"`` (resolved: never ``"auto"``).
        kernel_config: the engine's ``KernelConfig`` (every rank computes as rank 0 does).
        max_model_len: the engine's configured ``max_model_len`` (``None``: the model's context): it fixes the
            RoPE schemes that depend on it, the same on every rank (``registry.build_model``).
    """

    model: str
    dtype: str
    quantization: str
    device: str
    num_threads: Optional[int]
    num_blocks: int
    block_size: int
    world_size: int
    timeout_s: float
    port: int
    kv_cache_dtype: str = "float32"
    kernel_config: Optional[KernelConfig] = None
    max_model_len: Optional[int] = None

    def group(self, rank: int) -> TensorParallelGroup:
        """Rank ``rank``'s (not yet joined) ``TensorParallelGroup``."""
        return TensorParallelGroup(rank, self.world_size, timedelta(seconds=self.timeout_s))


def build_shard(spec: ShardSpec, group: TensorParallelGroup) -> CausalLM:
    """Load the checkpoint (weights only, uncached: only the shard stays in memory) and build this rank's shard."""
    from kvserve.model.backends import select_backends
    from kvserve.model.loader import load_model
    from kvserve.model.registry import build_model

    loaded = load_model(spec.model, spec.dtype, keep_quantized=spec.quantization != "fp32", weights_only=True)
    backends = select_backends(spec.device, loaded.weights["model.norm.weight"].dtype, spec.quantization,
                               spec.kernel_config, parallel=group)
    return build_model(loaded, backends, spec.max_model_len)


def worker_plan(plan: SchedulerOutput) -> SchedulerOutput:
    """What a worker needs of a step plan: token ids, positions, block tables, drafts and copy-on-write pairs.
    Sampling state (token histories, generators, draft distributions, grammar masks) stays on rank 0; only the number of samples
    per request is kept (it sets the logits rows), as ``None`` placeholders."""
    return SchedulerOutput(
        scheduled=[dataclasses.replace(s, spec_draft_probs=None, grammar_bitmask=None,
                                       sampling_states=[None] * len(s.sampling_states))
                   for s in plan.scheduled],
        block_copies=list(plan.block_copies),
    )


def forward_plan(model: CausalLM, kv_cache: torch.Tensor, plan: SchedulerOutput, block_size: int,
                 device: str = "cpu") -> torch.Tensor:
    """Copy-on-write copies, then the plan's forward over this rank's KV pool, as ``ModelRunner.execute_model``
    does before sampling. Returns the model's logits (full ``[S, V]`` on rank 0, the rank's slice elsewhere)."""
    for src, dst in plan.block_copies:
        kv_cache[:, :, dst].copy_(kv_cache[:, :, src])
    return model.forward(build_step_batch(plan.scheduled, block_size, device), kv_cache)


def worker_main(rank: int, spec: ShardSpec, conn) -> None:
    """Entry point of a spawned worker process: build the shard, report ``("ready", None)`` on ``conn``, join the
    group, then run each plan received until ``None`` (shutdown) or the pipe closes (the engine is gone). Any
    failure is reported as ``("error", traceback text)`` before the process exits."""
    group = spec.group(rank)
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        model = build_shard(spec, group)
        kv_cache = new_kv_pool(model.kv_cache_shape(spec.num_blocks, spec.block_size),
                               getattr(torch, spec.kv_cache_dtype), spec.device)
        conn.send(("ready", None))
        group.init(spec.port, spec.device)
        while True:
            plan = conn.recv()
            if plan is None:
                break
            forward_plan(model, kv_cache, plan, spec.block_size, spec.device)
    except EOFError:  # the engine closed the pipe: nothing to report to
        pass
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it naming this rank
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        group.destroy()
