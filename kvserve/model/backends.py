"""The backends a model computes with, chosen once at start-up for a device and dtype.

``select_backends`` is the one place that asks whether kvserve's CPU kernels can run here
(``cpu_kernels.load()``); the model, the attention layers and the draft proposer receive the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from kvserve.attention import AttentionBackend, select_attention_backend
from kvserve.layers.elementwise import CPUKernelOps, TorchOps
from kvserve.layers.linear import Linear, LinearMethod
from kvserve.model import cpu_kernels

logger = logging.getLogger(__name__)


@dataclass
class ModelBackends:
    """Attributes:
        device: ``"cpu"`` (``"cuda"`` once a GPU backend exists).
        attention: the ``AttentionBackend``.
        ops: RMSNorm and silu * up (``TorchOps`` or ``CPUKernelOps``).
        make_linear: weight ``[out, in]`` -> a ``LinearMethod``.
    """

    device: str
    attention: AttentionBackend
    ops: TorchOps
    make_linear: Callable[[torch.Tensor], LinearMethod]

    def describe(self, example: LinearMethod) -> str:
        """One log line: which implementation each kind of op uses (``example``: one built linear)."""
        return f"attention {self.attention.name}, linear {example.path}, norm/activation {self.ops.name}"


def select_backends(device: str, dtype: torch.dtype) -> ModelBackends:
    """Pick the attention backend, element-wise ops and linear method for ``device`` / ``dtype``.

    kvserve's CPU kernels are used for float32 on a CPU when they build and load here (AVX2, a C compiler,
    ``KVSERVE_CPU_KERNELS`` not ``0``); otherwise PyTorch's ops, with the same results to float32 rounding.

    Raises:
        ValueError: a device other than ``"cpu"``.
    """
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' (no other backend is built yet), got {device!r}")
    kernels = cpu_kernels.load() is not None
    reason = cpu_kernels.unavailable_reason()
    if reason:
        logger.info("kvserve CPU kernels unavailable: %s", reason)
    fast = kernels and dtype == torch.float32
    return ModelBackends(
        device=device,
        attention=select_attention_backend(device, dtype, kernels),
        ops=CPUKernelOps() if fast else TorchOps(),
        make_linear=partial(Linear, use_kernels=kernels),
    )
