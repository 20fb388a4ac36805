"""The grouped expert kernel (``kvserve.layers.grouped_experts``, csrc/qgemm_moe.h) against the per-expert path it
replaces: the same output bits on every kernel path, format and activation precision, for one row and for many
(AMX tiles, Q4_K's expanded groups), with rows that all pick one expert and experts nobody picks; gpt-oss's experts
(biases, the clamped SwiGLU, MXFP4) likewise, as a layer and in tiny gpt-oss models from Hugging Face and GGUF MXFP4
files; the experts' activation gives a row the same bits in any batch and on any thread count; and the layers it
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
from tests.model.test_families_gpt_oss import gpt_oss, gpt_oss_mxfp4  # noqa: F401 (fixtures)

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


def _moe(qtype, down_qtype, isa, activations, spec=RouterSpec(E, 3, "softmax_topk", True), seed=0,
         gpt_oss=False):
    """A layer of ``E`` random quantized experts; ``gpt_oss``: with gate/up and down biases and the clamped SwiGLU
    (gpt-oss's constants), its router biased and top-k-then-softmax as gpt-oss's."""
    rng = np.random.default_rng(seed)
    path = kernels.QuantPath(isa, activations)

    def bias(n):
        return torch.from_numpy((rng.standard_normal(n) * 2.0).astype(np.float32)) if gpt_oss else None

    experts = [ExpertMLP(make_linear_method([_tensor(rng, qtype, INTER, HIDDEN), _tensor(rng, qtype, INTER, HIDDEN)],
                                            path=path),
                         make_linear_method(_tensor(rng, down_qtype, HIDDEN, INTER), path=path),
                         "swiglu_oai" if gpt_oss else "silu", bias(2 * INTER), bias(HIDDEN))
               for _ in range(E)]
    router = Linear(torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(seed + 3)) * 0.3)
    return MoE(router, spec, experts, router_bias=bias(E))


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
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_gpt_oss_experts_equal_the_per_expert_path_bit_for_bit(isa, activations):
    """gpt-oss's experts (MXFP4, gate/up and down biases, the clamped SwiGLU with both clamps reached) on the
    grouped kernel: one row, a few and 300 give the per-expert path's bits, a row's bits alone as in the batch."""
    moe = _moe(formats.MXFP4, formats.MXFP4, isa, activations, spec=RouterSpec(E, 4, "topk_softmax"), seed=11,
               gpt_oss=True)
    assert moe.grouped is not None and moe.grouped.up_bias.shape == (E, 2 * INTER)
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(8)) * 4
    h = moe.experts[0].gate_up(x) + moe.experts[0].gate_up_bias
    assert (h[:, :INTER] > 7).any() and (h[:, INTER:] > 7).any() and (h[:, INTER:] < -7).any()  # clamps reached
    for rows in (1, 5, 53, 300):
        new, old = _both(moe, x[:rows])
        assert torch.equal(new, old), (rows, (new - old).abs().max())
    whole = moe(x)
    for t in (0, 17, 299):
        assert torch.equal(moe(x[t: t + 1]), whole[t: t + 1])


@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
def test_one_expert_for_every_row_and_experts_nobody_picks(gpt_oss):
    """A router that sends every row to experts 5 and 2 (the rest unpicked): the per-expert path's bits, for 1
    row and 300 (gpt-oss: its biases, activation and top-k-then-softmax router)."""
    qtype = formats.MXFP4 if gpt_oss else formats.Q8_0
    moe = _moe(qtype, qtype, PATHS[0], "int8", spec=RouterSpec(E, 2, "topk_softmax" if gpt_oss else "softmax_topk"),
               gpt_oss=gpt_oss)
    bias = torch.zeros(E)
    bias[5], bias[2] = 100.0, 50.0
    moe.router_bias = bias
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(1))
    for rows in (1, 40, 300):
        _, ids = moe.route(x[:rows])
        assert ids[:, 0].eq(5).all() and ids[:, 1].eq(2).all()
        new, old = _both(moe, x[:rows])
        assert torch.equal(new, old)


def test_expert_activation_bits_do_not_depend_on_the_batch_or_thread_count():
    """A row's activation (SwiGLU and gpt-oss's) is the same alone and among 51 rows of gpt-oss's width on 4
    threads, where PyTorch's sigmoid over the whole tensor would put a thread's scalar tail inside a row."""
    from kvserve.layers.expert_activation import expert_activation

    threads = torch.get_num_threads()
    h = torch.randn(51, 2 * 2880, generator=torch.Generator().manual_seed(3)) * 4
    try:
        torch.set_num_threads(4)
        for act in ("silu", "swiglu_oai"):
            whole = expert_activation(h, act)
            for t in range(51):
                assert torch.equal(expert_activation(h[t: t + 1], act), whole[t: t + 1]), (act, t)
        odd = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(4))  # a width not a whole vector step
        whole = expert_activation(odd, "swiglu_oai")
        assert all(torch.equal(expert_activation(odd[t: t + 1], "swiglu_oai"), whole[t: t + 1]) for t in range(5))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
def test_layers_the_kernel_cannot_run_keep_the_per_expert_path():
    """A bias on some experts only, activations or constants that differ between experts, float experts, and
    experts of different formats: no grouped kernel."""
    moe = _moe(formats.Q8_0, formats.Q8_0, PATHS[0], "int8")
    e = moe.experts
    assert moe.grouped is not None
    router = moe.router
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, "swiglu_oai") for x in e]).grouped is not None
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, down_bias=torch.zeros(HIDDEN) if i else None)
                                  for i, x in enumerate(e)]).grouped is None
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, "swiglu_oai" if i else "silu")
                                  for i, x in enumerate(e)]).grouped is None
    assert MoE(router, moe.spec, [ExpertMLP(x.gate_up, x.down, "swiglu_oai", limit=7.0 - (i == 3))
                                  for i, x in enumerate(e)]).grouped is None
    float_experts = [ExpertMLP(Linear(torch.randn(2 * INTER, HIDDEN)), Linear(torch.randn(HIDDEN, INTER)))] * E
    assert MoE(router, moe.spec, float_experts).grouped is None
    other = _moe(formats.Q4_0, formats.Q8_0, PATHS[0], "int8").experts
    assert MoE(router, moe.spec, e[:-1] + other[-1:]).grouped is None


def _all_layers(model, grouped: bool) -> None:
    """Every MoE layer of ``model`` on the grouped kernel (``grouped``) or on the per-expert path."""
    for layer in model.layers:
        moe = layer["moe"]
        moe.grouped = moe._grouped if grouped else None


@pytest.mark.real_model
@pytest.mark.skipif(not PATHS, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("source", ["hf_mxfp4", "gguf_mxfp4"])
@pytest.mark.parametrize("path", ["auto", "int8"])
def test_tiny_gpt_oss_runs_its_experts_grouped_with_the_per_expert_bits(request, tmp_path, tokenizer, source, path):
    """A tiny random gpt-oss with MXFP4 experts, from Hugging Face ``*_blocks`` / ``*_scales`` and from llama.cpp's
    GGUF: every MoE layer runs on the grouped kernel (the default path: MX4 weights; int8: every projection on a
    kernel, the experts as Q8), the experts' biases stacked, and a prompt's logits are the per-expert path's, bit
    for bit, on the Python layer loop and (int8) the C one."""
    from kvserve.config import KernelConfig
    from kvserve.model.backends import select_backends
    from kvserve.model.loader import load_model
    from kvserve.model.registry import build_model
    from kvserve.quant.pack import FMT_MX4
    from tests.model.test_families import PROMPTS, _logits
    from tests.model.test_families_gpt_oss import _write_gpt_oss_gguf

    if source == "hf_mxfp4":
        file = request.getfixturevalue("gpt_oss_mxfp4")[0]
    else:
        file = _write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", request.getfixturevalue("gpt_oss")[1], mxfp4=True)
    model = build_model(load_model(str(file), keep_quantized=True, weights_only=True),
                        select_backends("cpu", torch.float32, path, KernelConfig(quant_activations="int8x2")))
    assert (model.fused_layers is not None) == (path == "int8")
    for layer in model.layers:
        moe = layer["moe"]
        assert moe.grouped is not None and moe.grouped.activation == "swiglu_oai"
        assert moe.grouped.up[0] == moe.grouped.down[0] and (moe.grouped.up[0] == FMT_MX4) == (path == "auto")
        assert moe.grouped.down_bias.shape == (len(moe.experts), model.arch.hidden_size)
        moe._grouped = moe.grouped
    ids = tokenizer.encode(" ".join(PROMPTS))  # one sequence of every prompt: its rows choose varied experts
    assert len(ids) > 40
    moe, chosen = model.layers[1]["moe"], []
    moe.route = lambda x: chosen.append(type(moe).route(moe, x)) or chosen[-1]
    grouped = _logits(model, ids)
    del moe.route
    assert len(chosen[0][1].unique()) > 4  # the rows choose varied experts
    _all_layers(model, grouped=False)
    per_expert = _logits(model, ids)
    _all_layers(model, grouped=True)
    assert torch.equal(grouped, per_expert)
    if model.fused_layers is not None:  # the C layer loop calls back into the same MoE layers
        model.fused_layers, fused = None, model.fused_layers
        assert torch.equal(_logits(model, ids), grouped)
        model.fused_layers = fused
