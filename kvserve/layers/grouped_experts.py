"""A mixture-of-experts layer's routed experts in two C calls per step (``kvserve_moe_gemm``, csrc/qgemm_moe.h)
instead of two quantized matmuls per chosen expert: the gate/up projection of every (row, rank) pair grouped by
expert (each expert's gate/up bias added in C), the experts' activation over all of them at once in PyTorch
(``expert_activation``, the function ``ExpertMLP`` runs: SwiGLU, or gpt-oss's clamped SwiGLU), then the down
projection with each row's slots (plus their expert's down bias) weighted and summed in rank order, in C.

Every value equals ``kvserve.layers.moe``'s per-expert path bit for bit: a row's quantized matmul does not depend on
the other rows of its call, a bias add is one rounded float add either way, the activation gives an element the same
bits in any batch (``kvserve.layers.expert_activation``), and the sum is the same products and sums in the same
order (tests/model/test_grouped_experts.py). ``GroupedExperts.build`` returns ``None`` for experts it cannot run --
a float or padded weight, formats or kernel paths that differ between experts, some experts with a bias and others
without, different activation constants -- and the layer keeps the per-expert path.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.kernels import qgemm as kernels
from kvserve.layers.expert_activation import expert_activation
from kvserve.layers.quant_linear import QuantLinear


def _pointers(layers: list) -> Optional[tuple]:
    """``(fmt, isa, activations, in, out, weight addresses int64 [E], oscale addresses int64 [E] or None)`` of
    ``QuantLinear`` layers that one kernel call can run, else ``None``."""
    if not all(isinstance(m, QuantLinear) and m.kernel_weight is not None for m in layers):
        return None
    keys = {(m.packed.fmt, m.isa, m.activations, m.in_features, m.out_features) for m in layers}
    if len(keys) != 1:
        return None
    w = torch.tensor([m.packed.data.data_ptr() for m in layers], dtype=torch.int64)
    os = [0 if m.packed.oscale is None else m.packed.oscale.data_ptr() for m in layers]
    return (*keys.pop(), w, torch.tensor(os, dtype=torch.int64) if any(os) else None)


def _stacked_bias(experts: list, name: str) -> tuple[bool, Optional[torch.Tensor]]:
    """``(fits, bias)``: the experts' ``name`` biases stacked float32 ``[E, n]`` contiguous (each expert's bias then
    a view of its row: the same values, stored once), ``None`` when none has one; ``fits`` False when only some
    have one."""
    biases = [getattr(e, name) for e in experts]
    if all(b is None for b in biases):
        return True, None
    if any(b is None for b in biases):
        return False, None
    stacked = torch.stack([b.float() for b in biases]).contiguous()
    for e, row in zip(experts, stacked):
        setattr(e, name, row)
    return True, stacked


class GroupedExperts:
    """The routed experts of one MoE layer on the grouped kernel (see the module docstring).

    Args:
        experts: the layer's ``ExpertMLP`` list (kept: their packed weights are what the kernel reads).
        up, down: ``_pointers`` of their gate/up and down projections.
        up_bias, down_bias: float32 ``[E, 2 * intermediate]`` / ``[E, hidden]`` contiguous, or ``None``.

    Call with ``x [T, hidden]`` float32 contiguous, ``weights float32 [T, top_k]``, ``ids int64 [T, top_k]`` (the
    router's) -> ``[T, hidden]`` float32: each row's experts' outputs weighted and summed in rank order.

    Raises:
        RuntimeError: the kernel refused its arguments (an id outside ``[0, num_experts)``) or ran out of memory.
    """

    def __init__(self, experts: list, up: tuple, down: tuple, up_bias: Optional[torch.Tensor] = None,
                 down_bias: Optional[torch.Tensor] = None):
        self.experts, self.up, self.down = experts, up, down
        self.up_bias, self.down_bias = up_bias, down_bias
        first = experts[0]
        self.activation, self.alpha, self.limit = first.activation, first.alpha, first.limit
        self._lib = kernels.load()

    @classmethod
    def build(cls, experts: list) -> Optional["GroupedExperts"]:
        """The grouped kernel for ``experts`` (``kvserve.layers.moe.ExpertMLP`` of one activation and constants,
        all with biases or none, quantized weights of one format and kernel path), or ``None`` when any does not
        fit it. Stacks the experts' biases (``_stacked_bias``)."""
        if not experts or len({(getattr(e, "activation", None), getattr(e, "alpha", None), getattr(e, "limit", None))
                                for e in experts}) != 1:
            return None
        up, down = _pointers([e.gate_up for e in experts]), _pointers([e.down for e in experts])
        if up is None or down is None or kernels.load() is None or up[1] != down[1] or up[4] != 2 * down[3]:
            return None
        (up_fits, up_bias), (down_fits, down_bias) = (_stacked_bias(experts, n) for n in ("gate_up_bias",
                                                                                          "down_bias"))
        if not up_fits or not down_fits:
            return None
        return cls(experts, up, down, up_bias, down_bias)

    def _call(self, proj: tuple, down: bool, x: torch.Tensor, t: int, ids: torch.Tensor, y: torch.Tensor,
              bias: Optional[torch.Tensor], wt: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> None:
        fmt, isa, act, k, n, w, os = proj
        rc = self._lib.kvserve_moe_gemm(
            fmt, kernels.ISAS[isa], kernels.ACTIVATIONS[act], int(down), x.data_ptr(), t, k, ids.data_ptr(),
            ids.shape[1], len(self.experts), w.data_ptr(), None if os is None else os.data_ptr(),
            None if bias is None else bias.data_ptr(), n, y.data_ptr(), n, None if wt is None else wt.data_ptr(),
            None if out is None else out.data_ptr())
        if rc:
            raise RuntimeError(f"kvserve_moe_gemm returned {rc} (x {list(x.shape)}, {len(self.experts)} experts, "
                               f"ids {int(ids.min())}..{int(ids.max())})")

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        t, k = ids.shape
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        h = torch.empty(t * k, self.up[4], dtype=torch.float32)
        self._call(self.up, False, x, t, ids, h, self.up_bias)
        a = expert_activation(h, self.activation, self.alpha, self.limit)  # ExpertMLP's ops on the same rows
        slots = torch.empty(t * k, self.down[4], dtype=torch.float32)
        out = torch.empty(t, self.down[4], dtype=torch.float32) if out is None else out
        self._call(self.down, True, a, t, ids, slots, self.down_bias, weights, out)
        return out
