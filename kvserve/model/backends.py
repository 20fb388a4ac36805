"""The backends a model computes with, chosen once at start-up for a device, a dtype and the ``KernelConfig``.

``select_backends`` is the one place that asks whether kvserve's CPU kernels can run here (``cpu_kernels.load()``,
``qgemm.choose_path``) and decides which layer loop runs (``fused_layers``); the model, the attention layers and
the draft proposer receive the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from kvserve.attention import AttentionBackend, select_attention_backend
from kvserve.config import KernelConfig
from kvserve.layers.elementwise import CPUKernelOps, TorchOps
from kvserve.layers.linear import (ColumnParallelLinear, Linear, LinearMethod, ParallelGroup, RowParallelLinear,
                                   shard_rows)
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quant_linear import QuantEmbedding, make_linear_method
from kvserve.quant import QuantTensor
from kvserve.kernels import qgemm as quant_kernels

logger = logging.getLogger(__name__)


@dataclass
class ModelBackends:
    """Attributes:
        device: ``"cpu"`` (``"cuda"`` once a GPU backend exists).
        attention: the ``AttentionBackend``.
        ops: RMSNorm and silu * up (``TorchOps`` or ``CPUKernelOps``).
        make_linear: the parts of one projection (``[out_i, in]`` float tensors or GGUF ``QuantTensor`` blocks,
            stacked in order: q/k/v, gate/up) -> a ``LinearMethod``.
        quantization: ``"auto"``, ``"fp32"`` or ``"int8"`` (``ModelConfig.quantization``).
        quant_path: how quantized projections compute (``qgemm.QuantPath``: kernel path and activations).
        use_kernels: kvserve's float32 CPU kernels are in use (attention, norms, matmuls).
        fused_layers: the model runs its layer loop in one C call (``kvserve.model.fused_layers``) whenever the
            attention metadata says the whole step runs in the kernels: decided here, once, from the
            ``KernelConfig`` and what can run here (float32, one process, the CPU kernels and a quantized path).
        parallel: the tensor-parallel group this model is a shard of (``kvserve.distributed``), or ``None`` (the
            whole model in this process). ``column_linear`` / ``row_linear`` / ``column_bias`` apply the sharding
            spec when the model is built; with ``None`` they are ``make_linear`` / concatenation.
    """

    device: str
    attention: AttentionBackend
    ops: TorchOps
    make_linear: Callable[[list], LinearMethod]
    quantization: str = "auto"
    quant_path: quant_kernels.QuantPath = quant_kernels.QuantPath(None)
    use_kernels: bool = False
    fused_layers: bool = False
    parallel: Optional[ParallelGroup] = None

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks the model is split over (1: not split)."""
        return 1 if self.parallel is None else self.parallel.world_size

    def column_linear(self, parts: list, gather_output: bool = False, what: str = "weight") -> LinearMethod:
        """A fused projection split by output features over the ranks (q/k/v, gate/up; the LM head with
        ``gather_output``): ``ColumnParallelLinear``, or ``make_linear(parts)`` when not split."""
        if self.parallel is None:
            return self.make_linear(parts)
        return ColumnParallelLinear(parts, self.parallel, self.make_linear, gather_output, what)

    def row_linear(self, weight, what: str = "weight") -> LinearMethod:
        """A projection split by input features, summed over the ranks (o_proj, down_proj): ``RowParallelLinear``,
        or ``make_linear([weight])`` when not split."""
        if self.parallel is None:
            return self.make_linear([weight])
        return RowParallelLinear(weight, self.parallel, self.make_linear, what)

    def column_bias(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The biases of a ``column_linear`` projection, each cut like its weight's rows, concatenated."""
        if self.parallel is not None:
            parts = [shard_rows(b, self.parallel.rank, self.parallel.world_size, "bias") for b in parts]
        return torch.cat(parts)

    @staticmethod
    def make_embedding(table, tied_head=None) -> Callable[[torch.Tensor], torch.Tensor]:
        """Token lookup ``ids [T] -> [T, hidden]`` over a float ``[V, hidden]`` table, or over a GGUF ``QuantTensor``
        (only the looked-up rows are decoded: from ``tied_head``'s packed bytes when that LM head was built from
        this table and holds its exact values, else from the file; ``QuantEmbedding``)."""
        if isinstance(table, QuantTensor):
            return QuantEmbedding(table, tied_head)
        return partial(torch.nn.functional.embedding, weight=table)

    def describe(self, layer: LinearMethod, lm_head: LinearMethod,
                 kv_cache_dtype: Optional[torch.dtype] = None) -> str:
        """One log line: which implementation each kind of op uses (two built linears as examples; the attention
        kernel's build after a slash, e.g. ``cpu-kernels/amx``: the code that runs over a cache of
        ``kv_cache_dtype``, so ``avx512`` where the AMX build has no tiles for that cache type)."""
        build = getattr(self.attention, "isa", None)
        if build is not None and kv_cache_dtype is not None:
            build = cpu_kernels.attention_runs(build, kv_cache_dtype)
        attention = self.attention.name + (f"/{build}" if build else "")
        return (f"quantization {self.quantization}: attention {attention}, linear {layer.path} "
                f"(LM head {lm_head.path}), norm/activation {self.ops.name}")


def on_int8_kernels(layer: LinearMethod) -> bool:
    """Whether a built projection multiplies on the int8 kernels (a ``QuantLinear`` with a kernel path; inside a
    ``ConcatLinear`` or a tensor-parallel shard too), not in float: what ``kv_cache_dtype="auto"`` asks
    (``CacheConfig.resolve_kv_cache_dtype``)."""
    layer = getattr(layer, "local", layer)
    return any(getattr(p, "isa", None) is not None for p in getattr(layer, "parts", [layer]))


def select_backends(device: str, dtype: torch.dtype, quantization: str = "auto",
                    kernel_config: Optional[KernelConfig] = None,
                    parallel: Optional[ParallelGroup] = None) -> ModelBackends:
    """Pick the attention backend, element-wise ops, linear methods and layer loop for ``device`` / ``dtype`` /
    ``quantization`` / ``kernel_config`` (default: ``KernelConfig()``); ``parallel``: the tensor-parallel group
    when the model is built as one rank's shard.

    kvserve's CPU kernels are used for float32 on a CPU when ``cpu_kernels`` is on and they build and load here
    (AVX2, a C compiler); otherwise PyTorch's ops, with the same results to float32 rounding. Quantized weights
    (``QuantTensor``, or any weight under ``"int8"``) go to ``kvserve.layers.quant_linear``'s int8 dot-product
    kernels on the ``QuantPath`` chosen here, float weights to ``Linear``.

    Raises:
        ValueError: a device other than ``"cpu"``; a ``cpu_isa`` this CPU lacks or that fails its self-check
            (checked here, before any weight is packed or read from the cache).
    """
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' (no other backend is built yet), got {device!r}")
    kc = kernel_config if kernel_config is not None else KernelConfig()
    kernels = kc.cpu_kernels and cpu_kernels.load() is not None
    reason = cpu_kernels.unavailable_reason() if kc.cpu_kernels else "cpu_kernels=False"
    if reason:
        logger.info("kvserve CPU kernels not used: %s", reason)
    quant_path = quant_kernels.QuantPath(None)
    if quantization != "fp32":
        quant_path = quant_kernels.choose_path(kc.cpu_kernels, kc.cpu_isa, kc.quant_activations)
    fast = kernels and dtype == torch.float32
    return ModelBackends(
        device=device,
        attention=select_attention_backend(device, dtype, kernels, kc.cpu_isa),
        ops=CPUKernelOps() if fast else TorchOps(),
        make_linear=partial(_make_linear, quantization=quantization, path=quant_path, use_kernels=kernels),
        quantization=quantization,
        quant_path=quant_path,
        use_kernels=kernels,
        fused_layers=(kc.fused_layers and fast and parallel is None and quant_path.isa is not None
                      and quant_kernels.load() is not None),
        parallel=parallel,
    )


def _make_linear(parts: list, quantization: str, path: quant_kernels.QuantPath, use_kernels: bool) -> LinearMethod:
    """Float parts (any dtype) under ``"auto"`` / ``"fp32"``: one dense ``Linear`` on their concatenation; else
    ``make_linear_method`` (quantized blocks kept, or int8 quantized at load, on ``path``)."""
    if quantization != "int8" and not any(isinstance(p, QuantTensor) for p in parts):
        return Linear(torch.cat(parts) if len(parts) > 1 else parts[0], use_kernels=use_kernels)
    return make_linear_method(parts if len(parts) > 1 else parts[0], quantization, path, use_kernels)
