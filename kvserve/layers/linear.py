"""Linear methods: how a projection ``y = x @ W.T`` is stored and computed, chosen once per weight at load.

Every method offers the same call, ``method(x [T, in_features]) -> [T, out_features]``, plus ``numel()`` (weights
= multiply-adds per row), ``out_features``, ``in_features`` and ``path`` (which implementation runs), so the model
never asks how a weight is stored. ``Linear`` is the dense one; its paths, fastest that passes a self-check first:

1. ``kvserve`` (float32 CPU): kvserve's AVX2 kernel (``csrc/gemm_avx2.c``), weights packed into 16-feature panels.
2. ``onednn``: oneDNN with a weight re-laid-out once at load ("packed", as PyTorch's CPU inference freezing does),
   when the kernel cannot be built here (no AVX2, no C compiler) and PyTorch has oneDNN.
3. ``mkl``: ``(W @ x.T).T`` otherwise (bfloat16, ``pack=False``, other devices), faster than ``F.linear`` for skinny
   ``x`` on a CPU.

Measured side by side on this model's shapes: docs/performance.md ("CPU kernels").
"""

from __future__ import annotations

import numpy as np
import torch

from typing import Protocol

from kvserve.kernels import cpu as cpu_kernels


class LinearMethod(Protocol):
    """What the model calls: ``method(x [T, in_features]) -> [T, out_features]`` in the activation dtype."""

    out_features: int
    in_features: int
    path: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...

# Batch-size hint for oneDNN's weight layout; the packed weight works for any number of rows.
_PACK_HINT_ROWS = 16


def _onednn_ok(weight: torch.Tensor) -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear:
    """A bias-free linear layer.

    Args:
        weight: ``[out_features, in_features]``. When packed, the packed copy replaces it (same size, plus at most
            15 zero rows); ``weight`` then stays reachable only through the caller's own references.
        pack: try the packed paths (default; only float32 CPU weights are packed). A packed path is used only if a self-check on random input (1, 7 and
            19 rows: full and partial register blocks) matches MKL to 1e-4 relative.
        use_kernels: allow kvserve's own kernel (the backend selection passes ``False`` when it is off).

    Attributes:
        path: ``"kvserve"``, ``"onednn"`` or ``"mkl"``, the path in use.

    Call with ``x [T, in_features]`` (same dtype) -> ``[T, out_features]``.
    """

    def __init__(self, weight: torch.Tensor, pack: bool = True, use_kernels: bool = True):
        self.out_features, self.in_features = weight.shape
        self.packed, self.path, self.weight = None, "mkl", weight
        if not (pack and weight.dtype == torch.float32 and weight.device.type == "cpu"):
            return
        candidates = []
        if use_kernels and cpu_kernels.load() is not None:
            candidates.append(("kvserve", cpu_kernels.pack))
        if _onednn_ok(weight):
            candidates.append(("onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)))
        g = torch.Generator().manual_seed(0)
        for path, make in candidates:
            try:
                self.packed, self.path = make(weight), path
                ok = True
                for rows in (1, 7, 19):
                    x = torch.randn(rows, self.in_features, generator=g)
                    ref = torch.mm(weight, x.t()).t()
                    ok = ok and torch.allclose(self(x), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
                if ok:
                    self.weight = None
                    return
            except (RuntimeError, AttributeError):  # an op missing from this build: try the next path
                pass
        self.packed, self.path = None, "mkl"

    def numel(self) -> int:
        """Weights (= multiply-adds per row): ``out_features * in_features``."""
        return self.out_features * self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "kvserve":
            return cpu_kernels.gemm(x, self.packed, self.out_features)
        if self.path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return torch.mm(self.weight, x.t()).t().contiguous()


def linear_16bit(weight: torch.Tensor, use_kernels: bool = True):
    """A bias-free linear layer over a float16 or bfloat16 ``weight [out_features, in_features]`` (GGUF F16 / BF16)
    with float32 activations and sums: kvserve's matmul on the weight kept in 16 bits (``Linear16``, path
    ``f16/kvserve`` or ``bf16/kvserve``: half the bytes of float32, outputs equal to the float32 kernel's on the
    widened weight, bit for bit), or, without the kernels, a float32 ``Linear`` on the widened weight.

    Raises:
        ValueError: a weight of another dtype.
    """
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"linear_16bit takes a float16 or bfloat16 weight, got {weight.dtype}")
    if use_kernels and cpu_kernels.load() is not None:
        return Linear16(weight)
    return Linear(weight.float(), use_kernels=use_kernels)


class Linear16:
    """``linear_16bit``'s kernel layer: ``x [T, in_features]`` (converted to float32) -> ``[T, out_features]``
    float32. Attributes: ``path`` (``"f16/kvserve"`` / ``"bf16/kvserve"``), ``packed`` (16-bit panels)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = cpu_kernels.pack(weight.contiguous())
        self.path = f"{'bf16' if weight.dtype == torch.bfloat16 else 'f16'}/kvserve"

    def numel(self) -> int:
        """Weights (= multiply-adds per row): ``out_features * in_features``."""
        return self.out_features * self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gemm(x.to(torch.float32), self.packed, self.out_features)


# ------------------------------------------------------------------------------------------- tensor parallelism
# Megatron-LM's split of a transformer's matmuls (Shoeybi et al. 2019, sec. 3): a column-parallel layer keeps a
# slice of the output features (rows of ``W``) on each rank, so its output is the rank's slice and needs no
# communication; a row-parallel layer keeps a slice of the input features (columns of ``W``), takes the matching
# slice of its input and sums the ranks' partial products with one all-reduce. q/k/v and gate/up are
# column-parallel, o_proj and down_proj row-parallel: one all-reduce after attention and one after the MLP.


class ParallelGroup(Protocol):
    """The collectives the parallel layers call (``kvserve.distributed.parallel_state.TensorParallelGroup``)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the ranks (same shape on every rank)."""
        ...

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Rank 0: the ranks' ``x`` concatenated along ``dim`` in rank order; other ranks: ``x``."""
        ...


def _quant_tensor_type():
    from kvserve.quant.gguf_io import QuantTensor  # here: kvserve.layers.quant_linear imports this module

    return QuantTensor


def _split(size: int, rank: int, world_size: int, what: str) -> slice:
    if size % world_size:
        raise ValueError(f"{what}: {size} is not divisible by tensor_parallel_size={world_size}")
    n = size // world_size
    return slice(rank * n, (rank + 1) * n)


def shard_rows(weight, rank: int, world_size: int, what: str = "weight"):
    """Rank ``rank``'s contiguous slice of the output features (rows) of ``weight``: a float ``[out, in]`` or
    ``[out]`` tensor (a copy, contiguous), or a GGUF ``QuantTensor`` (whole rows of blocks: exact).

    Raises:
        ValueError: ``out`` not divisible by ``world_size`` (``what`` names the weight).
    """
    rows = _split(weight.shape[0], rank, world_size, f"{what} rows")
    if isinstance(weight, _quant_tensor_type()):
        return weight.take_rows(np.arange(rows.start, rows.stop))
    return weight[rows].contiguous()


def shard_cols(weight, rank: int, world_size: int, what: str = "weight"):
    """Rank ``rank``'s contiguous slice of the input features (columns) of ``weight [out, in]``: a float tensor
    (a copy, contiguous), or a GGUF ``QuantTensor`` cut between whole quantization blocks (exact: a block's
    scale covers only its own values).

    Raises:
        ValueError: ``in`` not divisible by ``world_size``, or (quantized) the slice not a whole number of blocks
            (K-quants have 256-value blocks), naming the weight.
    """
    cols = _split(weight.shape[1], rank, world_size, f"{what} columns")
    QuantTensor = _quant_tensor_type()
    if not isinstance(weight, QuantTensor):
        return weight[:, cols].contiguous()
    from kvserve.quant.formats import block_size

    values, nbytes = block_size(weight.qtype)
    if cols.start % values or cols.stop % values:
        raise ValueError(f"{what}: {weight.qtype.name} blocks of {values} values cannot be split into "
                         f"tensor_parallel_size={world_size} column slices of {cols.stop - cols.start}")
    raw = weight.raw[:, cols.start // values * nbytes : cols.stop // values * nbytes]
    return QuantTensor(weight.name, weight.qtype, np.ascontiguousarray(raw), (weight.shape[0], cols.stop - cols.start))


class ColumnParallelLinear:
    """A projection split by output features: each part (q, k, v or gate, up) is cut into ``world_size`` row
    slices and this rank keeps slice ``rank`` of each, fused in part order (``[q_r; k_r; v_r]``).

    Args:
        parts: ``[out_i, in]`` float tensors or ``QuantTensor`` blocks (``ModelBackends.make_linear``'s input).
        group: the ``ParallelGroup``.
        make_linear: builds the local ``LinearMethod`` from the sliced parts.
        gather_output: gather the slices to rank 0 (the vocabulary-parallel LM head: rank 0 gets the full
            ``[T, out]`` logits; the other ranks get their own ``[T, out / world_size]``).
        what: names the weight in errors.

    Call with ``x [T, in]`` -> ``[T, sum(out_i) / world_size]`` (or gathered, above).

    Raises:
        ValueError: an ``out_i`` not divisible by ``world_size``.
    """

    def __init__(self, parts: list, group: ParallelGroup, make_linear, gather_output: bool = False,
                 what: str = "weight"):
        self.group, self.gather_output = group, gather_output
        self.local = make_linear([shard_rows(p, group.rank, group.world_size, what) for p in parts])
        self.in_features, self.out_features = self.local.in_features, self.local.out_features
        self.path = f"{self.local.path}/tp{group.world_size}"

    def numel(self) -> int:
        """This rank's weights."""
        return self.local.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return self.group.gather(y, dim=-1) if self.gather_output else y


class RowParallelLinear:
    """A projection split by input features; the partial products are summed over the ranks (one all-reduce).

    Args:
        weight: ``[out, in]`` float tensor or ``QuantTensor``; this rank keeps columns ``rank`` of ``world_size``.
        group, make_linear, what: as ``ColumnParallelLinear``.

    Call with this rank's input slice ``x [T, in / world_size]`` -> the full ``[T, out]`` on every rank.

    Raises:
        ValueError: ``in`` not divisible (or, quantized, not in whole blocks).
    """

    def __init__(self, weight, group: ParallelGroup, make_linear, what: str = "weight"):
        self.group = group
        self.local = make_linear([shard_cols(weight, group.rank, group.world_size, what)])
        self.in_features, self.out_features = self.local.in_features, self.local.out_features
        self.path = f"{self.local.path}/tp{group.world_size}"

    def numel(self) -> int:
        """This rank's weights."""
        return self.local.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.local(x))
