"""The grouped expert kernel (``kvserve.layers.grouped_experts``, csrc/qgemm_moe.h) against the per-expert path it
replaces: the same output bits on every kernel path, format and activation precision, for one row and for many
(AMX tiles, Q4_K's expanded groups), with rows that all pick one expert and experts nobody picks; and the layers it
declines keep the per-expert path."""

import numpy as np
import pytest
import torch

import gguf
from kvserve.kernels import qgemm as kernels
from kvserve.layers.linear import Linear
from kvserve.layers.moe import MoE, ExpertMLP, RouterSpec
from kvserve.layers.quant_linear import make_linear_method
from kvserve.quant import QuantTensor, formats

E, HIDDEN, INTER = 8, 256, 256
PATHS = [p for p in kernels.ISAS if kernels.cpu_supports(p)]


#: K-quants as random blocks with small finite float16 scales: (block bytes, where the scales are).
_RANDOM_BLOCKS = {formats.Q4_K: (144, slice(0, 4)), formats.Q5_K: (176, slice(0, 4)), formats.Q6_K: (210, slice(208, 210))}


def _tensor(rng, qtype, n, k):
    if qtype in _RANDOM_BLOCKS:
        size, scales = _RANDOM_BLOCKS[qtype]
        raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        f16 = (scales.stop - scales.start) // 2
        raw[..., scales] = (rng.random((n, k // 256, f16)) * 0.002).astype("<f2").view(np.uint8)
        return QuantTensor("w", qtype, raw.reshape(n, -1), (n, k))
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    return QuantTensor("w", qtype, gguf.quants.quantize(w, qtype), (n, k))


def _moe(qtype, down_qtype, isa, activations, spec=RouterSpec(E, 3, "softmax_topk", True), seed=0):
    rng = np.random.default_rng(seed)
    path = kernels.QuantPath(isa, activations)
    experts = [ExpertMLP(make_linear_method([_tensor(rng, qtype, INTER, HIDDEN), _tensor(rng, qtype, INTER, HIDDEN)],
                                            path=path),
                         make_linear_method(_tensor(rng, down_qtype, HIDDEN, INTER), path=path))
               for _ in range(E)]
    router = Linear(torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(seed + 3)) * 0.3)
    return MoE(router, spec, experts)


def _both(moe, x):
    """(grouped kernel's output, the per-expert path's output) for ``x``."""
    grouped = moe.grouped
    assert grouped is not None
    try:
        new = moe(x)
        moe.grouped = None
        old = moe(x)
    finally:
        moe.grouped = grouped
    return new, old


@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("qtype,down_qtype", [(formats.Q4_K, formats.Q6_K), (formats.Q8_0, formats.Q8_0),
                                              (formats.Q4_0, formats.Q5_K), (formats.MXFP4, formats.MXFP4)])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_grouped_experts_equal_the_per_expert_path_bit_for_bit(isa, qtype, down_qtype, activations):
    """One row, a few, and 300 (16+ rows an expert: AMX tiles and Q4_K's expanded groups where they run) give the
    per-expert path's bits, and a row's bits are the same alone and in the batch."""
    moe = _moe(qtype, down_qtype, isa, activations, seed=int(qtype))
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(7))
    for rows in (1, 5, 53, 300):
        new, old = _both(moe, x[:rows])
        assert new.dtype == torch.float32 and new.shape == (rows, HIDDEN)
        assert torch.equal(new, old), (rows, (new - old).abs().max())
    whole = moe(x)
    for t in (0, 17, 299):
        assert torch.equal(moe(x[t: t + 1]), whole[t: t + 1])


@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
def test_one_expert_for_every_row_and_experts_nobody_picks():
    """A router that sends every row to experts 5 and 2 (the rest unpicked): the per-expert path's bits."""
    moe = _moe(formats.Q8_0, formats.Q8_0, PATHS[0], "int8", spec=RouterSpec(E, 2))
    bias = torch.zeros(E)
    bias[5], bias[2] = 100.0, 50.0
    moe.router_bias = bias
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, ids = moe.route(x)
    assert ids[:, 0].eq(5).all() and ids[:, 1].eq(2).all()
    new, old = _both(moe, x)
    assert torch.equal(new, old)


@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
def test_layers_the_kernel_cannot_run_keep_the_per_expert_path():
    """gpt-oss's activation, a bias, float experts, and experts of different formats: no grouped kernel."""
    moe = _moe(formats.Q8_0, formats.Q8_0, PATHS[0], "int8")
    e = moe.experts
    assert moe.grouped is not None
    router = moe.router
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, "swiglu_oai") for x in e]).grouped is None
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, down_bias=torch.zeros(HIDDEN)) for x in e]).grouped \
        is None
    float_experts = [ExpertMLP(Linear(torch.randn(2 * INTER, HIDDEN)), Linear(torch.randn(HIDDEN, INTER)))] * E
    assert MoE(router, moe.spec, float_experts).grouped is None
    other = _moe(formats.Q4_0, formats.Q8_0, PATHS[0], "int8").experts
    assert MoE(router, moe.spec, e[:-1] + other[-1:]).grouped is None
