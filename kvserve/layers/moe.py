"""Mixture-of-experts feed-forward layers: a router picks ``top_k`` experts per token row, each expert is a gated MLP,
and a row's output is its chosen experts' outputs weighted and summed (Shazeer et al. 2017, "Outrageously large
neural networks"; Jiang et al. 2024, "Mixtral of experts"). Call ``moe(x [T, hidden] float32) -> [T, hidden]``.

Routers (``RouterSpec.scoring``), as each family's reference (``transformers``) computes them:

- ``"softmax_topk"``: softmax over all experts' logits in float32, then the ``top_k`` largest probabilities;
  ``renormalize`` divides them by their sum (Mixtral always; Qwen2-MoE, Qwen3-MoE and OLMoE when their config's
  ``norm_topk_prob`` is true, which it is not by default for Qwen2-MoE and OLMoE).
- ``"topk_softmax"``: the ``top_k`` largest logits, then a softmax over those alone (gpt-oss, whose router has a
  bias; Granite-MoE).

Ties: the experts chosen among equal scores, and their order, are ``torch.topk``'s (the references' own call), which
on the CPU is *not* lowest-id-first (eight equal scores, ``k = 3``: experts 6, 5, 4) but is a function of the row
alone: the same row picks the same experts in the same order alone or in any batch (tests/model/test_moe.py).

The expert step groups the step's ``T * top_k`` (row, rank) pairs by expert, runs each chosen expert once over
all its rows (quantized experts of one format: all experts in two C calls, ``grouped_experts``; else one linear
call per expert and projection, ``run_experts``; the same bits) (its linear methods: any quantized format of ``kvserve.quant.traits`` -- MXFP4 included -- or float),
and writes each result to its (row, rank) slot; then each row sums its ``top_k`` weighted slots **in rank order**
(rank 0 = the highest score), a fixed order per row, never the grouping's. Every matmul is row-independent
(batch-invariant kernels), so a token's output bits are the same alone, beside rows that chose other experts, or in
any chunk. A shared expert (Qwen2-MoE) is added after the routed sum, times ``sigmoid(shared_gate(x))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.layers.expert_activation import ACTIVATIONS, expert_activation
from kvserve.layers.grouped_experts import GroupedExperts

#: Router scoring functions (see the module docstring).
SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class RouterSpec:
    """How a family's router turns logits into experts and weights.

    Attributes:
        num_experts: experts in the layer (``E``).
        top_k: experts per row, 1..``num_experts``.
        scoring: one of ``SCORINGS``.
        renormalize: with ``"softmax_topk"``, divide the chosen probabilities by their sum.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False

    def __post_init__(self):
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {self.num_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k (num_experts_per_tok) must be in [1, {self.num_experts}], got {self.top_k!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.renormalize and self.scoring != "softmax_topk":
            raise ValueError("renormalize applies to scoring 'softmax_topk' only")


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits -> each row's experts and weights.

    Args:
        logits: ``[T, num_experts]`` (any float dtype; computed in float32).
        spec: the family's ``RouterSpec``.

    Returns:
        ``(weights float32 [T, top_k], ids int64 [T, top_k])``, by descending score (``torch.topk``'s order; ties as
        the module docstring says).

    Raises:
        ValueError: ``logits`` not ``[T, num_experts]``.
    """
    if logits.dim() != 2 or logits.shape[1] != spec.num_experts:
        raise ValueError(f"router logits must be [T, {spec.num_experts}], got {list(logits.shape)}")
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    top, ids = torch.topk(torch.softmax(logits, dim=-1), spec.top_k, dim=-1)
    if spec.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


class ExpertMLP:
    """One gated MLP: ``down(act(gate(x), up(x)))`` with the gate and up projections fused in one linear method.

    Args:
        gate_up: a linear method (``kvserve.layers.linear`` / ``quant_linear``) of ``2 * intermediate`` outputs:
            the gate's rows, then the up's (gpt-oss's interleaved rows are reordered at load: ``deinterleave_index``).
        down: a linear method ``intermediate -> hidden``.
        activation: one of ``ACTIVATIONS`` (``kvserve.layers.expert_activation``).
        gate_up_bias, down_bias: float32 ``[2 * intermediate]`` / ``[hidden]`` or ``None`` (gpt-oss has both).
        alpha, limit: ``"swiglu_oai"``'s constants (gpt-oss: 1.702 and 7.0).

    Call with ``x [T, hidden] float32`` -> ``[T, hidden] float32``.

    Raises:
        ValueError: an unknown activation, or shapes that do not chain.
    """

    def __init__(self, gate_up, down, activation: str = "silu", gate_up_bias: Optional[torch.Tensor] = None,
                 down_bias: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if gate_up.out_features % 2 or down.in_features != gate_up.out_features // 2:
            raise ValueError(f"gate_up has {gate_up.out_features} outputs, down {down.in_features} inputs: need "
                             f"2 * intermediate and intermediate")
        self.gate_up, self.down, self.activation = gate_up, down, activation
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self.alpha, self.limit = float(alpha), float(limit)
        self.intermediate = down.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias
        y = self.down(expert_activation(h, self.activation, self.alpha, self.limit))
        return y + self.down_bias if self.down_bias is not None else y

    def numel(self) -> int:
        return self.gate_up.numel() + self.down.numel()


def deinterleave_index(n: int) -> torch.Tensor:
    """Row order that turns interleaved gate/up rows (gpt-oss: gate at even rows, up at odd) into gate rows then up
    rows: ``w_fused = w_interleaved[index]`` (exact for quantized rows too: rows are independent blocks)."""
    if n % 2:
        raise ValueError(f"an interleaved gate/up projection has an even number of rows, got {n}")
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


class MoE:
    """A sparse mixture-of-experts layer (see the module docstring).

    Args:
        router: a linear method ``hidden -> num_experts`` (float32 logits).
        spec: the family's ``RouterSpec``.
        experts: ``num_experts`` ``ExpertMLP`` (or any callable ``[t, hidden] -> [t, hidden]``).
        router_bias: float32 ``[num_experts]`` or ``None`` (gpt-oss).
        shared_expert: an ``ExpertMLP`` every row runs, or ``None`` (Qwen2-MoE).
        shared_gate: a linear method ``hidden -> 1``: the shared expert's output is scaled by ``sigmoid`` of it
            (``None``: unscaled).

    Call with ``x [T, hidden] float32`` -> ``[T, hidden] float32``.

    Raises:
        ValueError: experts that do not match ``spec.num_experts``, or a router of the wrong width.
    """

    def __init__(self, router, spec: RouterSpec, experts: list, router_bias: Optional[torch.Tensor] = None,
                 shared_expert=None, shared_gate=None):
        if len(experts) != spec.num_experts:
            raise ValueError(f"{len(experts)} experts given, num_experts is {spec.num_experts}")
        if router.out_features != spec.num_experts:
            raise ValueError(f"router has {router.out_features} outputs, num_experts is {spec.num_experts}")
        self.router, self.spec, self.experts = router, spec, list(experts)
        self.router_bias, self.shared_expert, self.shared_gate = router_bias, shared_expert, shared_gate
        #: The routed experts on the grouped C kernel (``GroupedExperts``: two calls a step, the same bits), or
        #: ``None``: one call per chosen expert and projection (``run_experts``).
        self.grouped = GroupedExperts.build(self.experts) if all(isinstance(e, ExpertMLP) for e in experts) \
            else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(weights float32 [T, top_k], ids int64 [T, top_k])`` (``route``)."""
        logits = self.router(x)
        if self.router_bias is not None:
            logits = logits + self.router_bias
        return route(logits, self.spec)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        k = self.spec.top_k
        weights, ids = self.route(x)
        if self.grouped is not None:
            y = self.grouped(x, weights, ids)
        else:
            slots = run_experts(x, ids, self.experts)  # [T, top_k, hidden]
            y = slots[:, 0] * weights[:, :1]
            for r in range(1, k):  # rank order, fixed per row
                y = y + slots[:, r] * weights[:, r: r + 1]
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + s
        return y

    def numel(self) -> int:
        """Weights a row reads: the router, ``top_k`` experts (the first, as representative) and the shared one."""
        shared = self.shared_expert.numel() if self.shared_expert is not None else 0
        return self.router.numel() + self.spec.top_k * self.experts[0].numel() + shared


def run_experts(x: torch.Tensor, ids: torch.Tensor, experts: list) -> torch.Tensor:
    """Each row through each of its chosen experts, grouped by expert: ``x [T, hidden]``, ``ids int64 [T, top_k]``
    -> ``[T, top_k, out]`` where slot ``(t, r)`` is ``experts[ids[t, r]](x[t])``. Each chosen expert runs once,
    over all its rows in row order; an expert no row chose does not run."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (row, rank) pairs grouped by expert, rows ascending in each group
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = None
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        pairs = order[start: start + c]
        start += c
        h = experts[e](x.index_select(0, pairs // k))
        if out is None:
            out = h.new_empty(t * k, h.shape[1])
        out.index_copy_(0, pairs, h)
    if out is None:
        return x.new_zeros(t, k, x.shape[1])
    return out.view(t, k, -1)
