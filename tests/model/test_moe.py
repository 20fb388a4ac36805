"""kvserve.layers.moe against transformers' MoE blocks on tiny random float32 weights (Mixtral, Qwen2-MoE with its
gated shared expert, Qwen3-MoE with norm_topk_prob, OLMoE, Granite-MoE, gpt-oss's MLP with its biased router and
clamped SwiGLU), router edge cases (ties, every row on one expert, experts nobody picks, 1 and 300 rows), and batch
invariance bit for bit on the quantized path (Q4_K, Q8_0 and MXFP4 experts)."""

import numpy as np
import pytest
import torch

import gguf
from kvserve.kernels import qgemm as kernels
from kvserve.layers.linear import Linear
from kvserve.layers.moe import MoE, ExpertMLP, RouterSpec, deinterleave_index, route, run_experts
from kvserve.layers.quant_linear import make_linear_method
from kvserve.quant import QuantTensor, formats

H, I, E, K = 64, 96, 8, 2


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def _config(cls, **kw):
    cfg = cls(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, **kw)
    cfg._experts_implementation = "eager"
    return cfg


def _experts(gate_up, down, **kw):
    """Per-expert ``ExpertMLP`` of float32 ``Linear`` from stacked ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""
    return [ExpertMLP(Linear(gate_up[e].detach().clone()), Linear(down[e].detach().clone()), **kw)
            for e in range(gate_up.shape[0])]


def _block(family, seed=0):
    """``(transformers block, kvserve MoE, forward(block, x))`` over the same random weights."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        ref = _init(MixtralSparseMoeBlock(_config(MixtralConfig, intermediate_size=I, num_local_experts=E,
                                                  num_experts_per_tok=K)), seed)
        moe = MoE(Linear(ref.gate.weight.detach().clone()), RouterSpec(E, K, "softmax_topk", True),
                  _experts(ref.experts.gate_up_proj, ref.experts.down_proj))
    elif family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        if family == "qwen2_moe":
            from transformers import Qwen2MoeConfig as C
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as B
            extra = dict(shared_expert_intermediate_size=80, norm_topk_prob=False)
        elif family == "qwen3_moe":
            from transformers import Qwen3MoeConfig as C
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
            extra = dict(norm_topk_prob=True)
        else:
            from transformers import OlmoeConfig as C
            from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as B
            extra = dict(norm_topk_prob=False, intermediate_size=I)
        cfg = _config(C, num_experts=E, num_experts_per_tok=K, **extra)
        if family != "olmoe":
            cfg.moe_intermediate_size = I
        ref = _init(B(cfg), seed)
        shared = gate = None
        if family == "qwen2_moe":
            se = ref.shared_expert
            shared = ExpertMLP(Linear(torch.cat([se.gate_proj.weight, se.up_proj.weight]).detach().clone()),
                               Linear(se.down_proj.weight.detach().clone()))
            gate = Linear(ref.shared_expert_gate.weight.detach().clone())
        moe = MoE(Linear(ref.gate.weight.detach().clone()), RouterSpec(E, K, "softmax_topk", cfg.norm_topk_prob),
                  _experts(ref.experts.gate_up_proj, ref.experts.down_proj), shared_expert=shared, shared_gate=gate)
    elif family == "granitemoe":
        from transformers import GraniteMoeConfig
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE
        ref = _init(GraniteMoeMoE(_config(GraniteMoeConfig, intermediate_size=I, num_local_experts=E,
                                          num_experts_per_tok=K)), seed)
        moe = MoE(Linear(ref.router.weight.detach().clone()), RouterSpec(E, K, "topk_softmax"),
                  _experts(ref.experts.gate_up_proj, ref.experts.down_proj))
    elif family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
        cfg = _config(GptOssConfig, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        ref = _init(GptOssMLP(cfg), seed)
        ex, idx = ref.experts, deinterleave_index(2 * I)
        experts = [ExpertMLP(Linear(ex.gate_up_proj[e].T[idx].detach().contiguous()),
                             Linear(ex.down_proj[e].T.detach().contiguous()), "swiglu_oai",
                             ex.gate_up_proj_bias[e][idx].detach().clone(), ex.down_proj_bias[e].detach().clone(),
                             alpha=cfg.swiglu_alpha if hasattr(cfg, "swiglu_alpha") else 1.702,
                             limit=cfg.swiglu_limit) for e in range(E)]
        moe = MoE(Linear(ref.router.weight.detach().clone()), RouterSpec(E, K, "topk_softmax"), experts,
                  router_bias=ref.router.bias.detach().clone())
    else:
        raise AssertionError(family)

    def forward(x):
        with torch.no_grad():
            out = ref(x[None])
        return (out[0] if isinstance(out, tuple) else out)[0]

    return ref, moe, forward


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_moe_block_equals_transformers(family, rows):
    """The float32 path equals the family's transformers block (routing, renormalisation, shared expert and its
    gate, gpt-oss's biases and clamped SwiGLU) to float32 rounding."""
    _, moe, forward = _block(family, seed=rows)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    got, want = moe(x), forward(x)
    assert got.shape == want.shape == (rows, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routers_match_the_references_formulas():
    """softmax -> top-k (with and without renormalisation) and top-k -> softmax, on one set of logits."""
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(1))
    p = torch.softmax(logits, -1)
    v, i = torch.topk(p, K, -1)
    w, ids = route(logits, RouterSpec(E, K, "softmax_topk"))
    assert torch.equal(ids, i) and torch.equal(w, v)
    w, ids = route(logits, RouterSpec(E, K, "softmax_topk", True))
    assert torch.equal(ids, i) and torch.equal(w, v / v.sum(-1, keepdim=True))
    v, i = torch.topk(logits, K, -1)
    w, ids = route(logits, RouterSpec(E, K, "topk_softmax"))
    assert torch.equal(ids, i) and torch.equal(w, torch.softmax(v, -1))


@pytest.mark.parametrize("spec", [RouterSpec(8, 3, "softmax_topk", True), RouterSpec(8, 3, "topk_softmax"),
                                  RouterSpec(64, 8, "softmax_topk"), RouterSpec(128, 8, "topk_softmax")])
def test_ties_are_torch_topks_and_depend_on_the_row_alone(spec):
    """Tied scores: the experts and their order are torch.topk's (not lowest-id-first), the same for a row alone
    and inside batches of 2..300 rows."""
    e = spec.num_experts
    rows = torch.zeros(300, e)
    rows[1, 5] = 1.0
    rows[2, ::2] = 0.5
    rows[3] = torch.arange(e).float() % 3  # three-way ties at the top
    rows[4:] = torch.randint(0, 3, (296, e), generator=torch.Generator().manual_seed(0)).float()
    w, ids = route(rows, spec)
    ref_v, ref_i = torch.topk(torch.softmax(rows, -1) if spec.scoring == "softmax_topk" else rows, spec.top_k, -1)
    assert torch.equal(ids, ref_i)
    if spec.num_experts == 8 and spec.top_k == 3:
        assert ids[0].tolist() != [0, 1, 2]  # all equal: not lowest-id-first
    for n in (1, 2, 17, 300):
        for t in (0, 1, 3, n - 1):
            if t < n:
                w1, i1 = route(rows[:n][t: t + 1], spec)
                assert torch.equal(i1[0], ids[t]) and torch.equal(w1[0], w[t])


def test_every_row_on_one_expert_and_experts_nobody_picks():
    """A router that sends every row to expert 3 first (and 5 second): only those experts run, each once over all
    rows; the output still equals transformers'."""
    ref, moe, forward = _block("mixtral", seed=4)
    calls = []
    for e, ex in enumerate(moe.experts):
        moe.experts[e] = (lambda ex, e: (lambda x: (calls.append((e, x.shape[0])), ex(x))[1]))(ex, e)
    logits_w = torch.zeros(E, H)
    logits_w[3, 0], logits_w[5, 0] = 10.0, 5.0
    moe.router = Linear(logits_w)
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(2))
    x[:, 0] = x[:, 0].abs() + 1.0  # logit of expert 3 > expert 5 > the rest (0)
    with torch.no_grad():
        ref.gate.weight.copy_(logits_w)
    got = moe(x)
    assert sorted(calls) == [(3, 300), (5, 300)]
    torch.testing.assert_close(got, forward(x), rtol=1e-5, atol=1e-5)


def test_run_experts_fills_every_rank_slot():
    """Slot (t, r) holds expert ids[t, r] of row t, whatever the grouping order."""
    x = torch.randn(5, 4)
    experts = [lambda v, e=e: v * (e + 1) for e in range(4)]
    ids = torch.tensor([[3, 0], [0, 3], [2, 1], [1, 2], [3, 1]])
    out = run_experts(x, ids, experts)
    for t in range(5):
        for r in range(2):
            assert torch.equal(out[t, r], x[t] * (ids[t, r] + 1))


def test_bad_router_specs_are_value_errors():
    with pytest.raises(ValueError, match=r"top_k \(num_experts_per_tok\) must be in \[1, 8\], got 9"):
        RouterSpec(8, 9)
    with pytest.raises(ValueError, match="scoring must be one of"):
        RouterSpec(8, 2, "sigmoid")
    with pytest.raises(ValueError, match="renormalize applies to scoring 'softmax_topk' only"):
        RouterSpec(8, 2, "topk_softmax", True)
    with pytest.raises(ValueError, match=r"router logits must be \[T, 8\]"):
        route(torch.zeros(3, 7), RouterSpec(8, 2))


def _quant_experts(qtype, seed, activation="silu"):
    """``E`` experts whose gate/up and down are GGUF ``qtype`` tensors on the quantized kernels."""
    rng = np.random.default_rng(seed)
    k_in, inter = 256, 256

    def tensor(n, k):
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        if qtype == formats.Q4_K:  # random Q4_K blocks with finite scales
            raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
            raw[..., 0:4] = (rng.random((n, k // 256, 2)) * 0.002).astype("<f2").view(np.uint8)
            return QuantTensor("w", qtype, raw.reshape(n, -1), (n, k))
        return QuantTensor("w", qtype, gguf.quants.quantize(w, qtype), (n, k))

    return [ExpertMLP(make_linear_method(tensor(2 * inter, k_in)), make_linear_method(tensor(k_in, inter)), activation)
            for _ in range(E)], k_in


@pytest.mark.skipif(kernels.isa() is None, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("qtype", [formats.Q4_K, formats.Q8_0, formats.MXFP4])
@pytest.mark.parametrize("spec", [RouterSpec(E, K, "softmax_topk", True), RouterSpec(E, 3, "topk_softmax")])
def test_quantized_moe_is_batch_invariant_bit_for_bit(qtype, spec):
    """On the quantized kernels a row's output bits are the same alone, in any batch (beside rows that pick other
    experts), and in chunks of any size."""
    act = "swiglu_oai" if qtype == formats.MXFP4 else "silu"
    experts, hidden = _quant_experts(qtype, seed=int(qtype), activation=act)
    router = Linear(torch.randn(E, hidden, generator=torch.Generator().manual_seed(3)) * 0.3)
    moe = MoE(router, spec, experts)
    assert experts[0].gate_up.path.split("/")[0] == {formats.Q4_K: "q4_k", formats.Q8_0: "q8",
                                                     formats.MXFP4: "mxfp4"}[qtype]
    x = torch.randn(53, hidden, generator=torch.Generator().manual_seed(9))
    whole = moe(x)
    _, ids = moe.route(x)
    assert len(set(ids[:, 0].tolist())) > 2  # rows pick different experts
    for t in (0, 7, 16, 31, 52):
        assert torch.equal(moe(x[t: t + 1]), whole[t: t + 1])
    for chunk in (5, 16, 17):
        parts = torch.cat([moe(x[i: i + chunk]) for i in range(0, 53, chunk)])
        assert torch.equal(parts, whole)
    perm = torch.randperm(53, generator=torch.Generator().manual_seed(1))
    assert torch.equal(moe(x[perm]), whole[perm])


@pytest.mark.skipif(kernels.isa() is None, reason=str(kernels.unavailable_reason()))
def test_gguf_stacked_mxfp4_experts_compute_their_values():
    """Experts from llama.cpp's stacked tensors (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, MXFP4, as
    gguf_io reads a 3-D tensor: ``expert(e)`` views) on the kernels equal the same MoE over their dequantized float32
    values to the activations' int8 rounding."""
    rng = np.random.default_rng(5)
    hidden, inter = 256, 128

    def stacked(name, n, k):
        raw = gguf.quants.quantize((rng.standard_normal((E * n, k)) * 0.1).astype(np.float32), formats.MXFP4)
        return QuantTensor(name, formats.MXFP4, raw, (E * n, k), experts=E)

    gate, up, down = stacked("g", inter, hidden), stacked("u", inter, hidden), stacked("d", hidden, inter)
    router = Linear(torch.randn(E, hidden, generator=torch.Generator().manual_seed(0)) * 0.3)
    spec = RouterSpec(E, K, "topk_softmax")
    quant = MoE(router, spec, [ExpertMLP(make_linear_method([gate.expert(e), up.expert(e)]),
                                         make_linear_method(down.expert(e)), "swiglu_oai") for e in range(E)])
    dense = MoE(router, spec, [ExpertMLP(Linear(torch.from_numpy(np.concatenate([gate.expert(e).dequantize(),
                                                                                  up.expert(e).dequantize()]))),
                                         Linear(torch.from_numpy(down.expert(e).dequantize())), "swiglu_oai")
                               for e in range(E)])
    assert quant.experts[3].gate_up.path.startswith("mxfp4/")
    x = torch.randn(20, hidden, generator=torch.Generator().manual_seed(1))
    got, want = quant(x), dense(x)
    assert torch.equal(quant.route(x)[1], dense.route(x)[1])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))
