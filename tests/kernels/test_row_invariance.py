"""Everything but attention is row-wise (issue 39, item 2): a row's result is the same bits whether it is computed
alone, as row i of M rows (M = 1, 2, 5, 16, 64, 300: every row tile, AMX threshold, stack/heap scratch and
serial/parallel threshold of the kernels), at any place in the batch, and with 1 or 2 OpenMP threads.

Covered: the quantized matmul (``kernels.qgemm`` and ``QuantLinear``: Q4, Q4F, Q5F, Q8, Q6 and per-channel int8 weights x
every ISA path this CPU runs x both activation quantizations), the float32 matmul (``kernels.cpu.gemm`` through
``Linear``), RMSNorm / add+RMSNorm / silu*up (C kernels and the PyTorch ops), the RoPE tables, and the sampler's
logits path (log-softmax logprobs, temperature / top-k / top-p / min-p distributions, seeded draws).

Thread counts: both kernel libraries link ``libgomp.so.1`` and load after PyTorch, whose wheel ships a
``libgomp.so.1`` of that soname, so they bind to PyTorch's OpenMP runtime and ``torch.set_num_threads`` (which sets
the calling thread's OpenMP ``nthreads-var``) is what sets their thread count (``test_torch_set_num_threads_...``).
Only small random tensors: no model is loaded.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import qgemm as qk
from kvserve.layers.elementwise import CPUKernelOps, TorchOps
from kvserve.layers.linear import Linear
from kvserve.layers.quant_linear import QuantLinear, make_linear_method
from kvserve.layers.rotary import RopeTable, apply_rotary, rope_cos_sin, rope_inv_freq
from kvserve.quant import pack as P
from kvserve.sample import nucleus
from kvserve.sample.sampler import Sampler
from kvserve.sample.state import SamplingState
from kvserve.sampling_params import SamplingParams

#: Batch sizes: 1-6 rows (partial AVX2 / AVX-512 row tiles), 16 (one AMX tile), 64 (four AMX tiles), 300
#: (parallel activation quantization, heap scratch, a 12-row VNNI tail after the AMX tiles).
ROWS = (1, 2, 5, 16, 64, 300)
THREADS = (1, 2)

_no_cpu_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))
_no_qgemm = pytest.mark.skipif(qk.load() is None, reason=str(qk.unavailable_reason()))


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _alone(fn, n: int) -> torch.Tensor:
    return torch.cat([fn(torch.tensor([i])) for i in range(n)])


def _assert_equal_rows(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if not torch.equal(got, ref):
        bad = (got != ref).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: rows {bad[:8]} differ from the same rows computed alone on one thread "
                             f"(max abs diff {(got - ref).abs().max().item():.3g})")


def assert_row_invariant(fn, n: int, rows=ROWS, threads=THREADS) -> None:
    """``fn(idx [M] int64) -> [M, ...]``, the result for rows ``idx`` of some fixed data, is the same bits for a row
    whatever else is in the call: each row alone on one thread is the reference; then, on each thread count, each row
    alone, every ``M`` of ``rows`` at the start, middle and end of the data, and all ``n`` rows shuffled."""
    with _threads(1):
        ref = _alone(fn, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for t in threads:
        with _threads(t):
            if t != 1:
                _assert_equal_rows(_alone(fn, n), ref, f"alone, {t} threads")
            for m in rows:
                for start in sorted({0, (n - m) // 2, n - m}):
                    idx = torch.arange(start, start + m)
                    _assert_equal_rows(fn(idx), ref[idx], f"M={m} from row {start}, {t} threads")
            _assert_equal_rows(fn(perm), ref[perm], f"all {n} rows shuffled, {t} threads")


def _x(n: int, k: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    x[3, :5] = torch.tensor([40.0, -40.0, 0.0, 1e-3, -7.0])  # an outlier block
    x[7] = 0.0  # an all-zero row: zero activation scales
    return x


# ---------------------------------------------------------------------------------------------- thread control


@_no_qgemm
@_no_cpu_kernels
def test_torch_set_num_threads_sets_the_kernels_openmp_thread_count():
    """Both C libraries resolve ``omp_*`` to PyTorch's own OpenMP runtime, so ``torch.set_num_threads`` on the
    calling thread is what their parallel regions use (``OMP_NUM_THREADS`` only sets the start-up default)."""
    for lib in (cpu_kernels.load(), qk.load()):
        max_threads = lib.omp_get_max_threads
        for n in (1, 2):
            with _threads(n):
                assert max_threads() == n


# --------------------------------------------------------------------------------------------- quantized matmul


def _isa_params():
    return [pytest.param(name, marks=pytest.mark.skipif(not qk.cpu_supports(name), reason=f"CPU lacks {name}"))
            for name in qk.ISAS]


def _isa_act_params():
    """Every (path, activations) pair: ``"bf16"`` only on ``amx_int8`` (skipped where the CPU lacks AMX-BF16)."""
    def runs(name, act):
        return qk.cpu_supports(name) and (act != "bf16" or qk.activations_supported(name, act))
    return [pytest.param(name, act, id=f"{name}-{act}",
                         marks=pytest.mark.skipif(not runs(name, act), reason=f"CPU lacks {name} with {act}"))
            for name in qk.ISAS for act in qk.ACTIVATIONS if act != "bf16" or name == "amx_int8"]


def _packed(fmt: str, n: int, k: int, seed: int = 3) -> P.PackedWeight:
    """Random weights in one of the kernel's formats: ``q4`` (float16 scales and mins: GGUF Q4_0 / Q4_1), ``q4f``
    (float32 ones), ``q4k`` (Q4_K as stored; k a multiple of 256), ``q8`` (float16 scales: Q8_0, "int8"),
    ``int8_oscale`` (Q8 with a per-output-channel factor), ``q6`` (Q6_K's values; k a multiple of 256) and ``q5f``
    (Q5_K's)."""
    rng = np.random.default_rng(seed)
    nb = k // P.QK
    if fmt == "q6":
        q = rng.integers(0, 64, (n, k), dtype=np.uint8)
        sc = rng.integers(-128, 128, (n, k // 16)).astype(np.int8)
        return P.pack_q6(q, sc, (rng.random((n, k // 256)) * 0.01 + 0.001).astype(np.float16))
    if fmt == "q4k":  # GGUF Q4_K's compact layout: 6-bit sc, mn per 32, float16 d, dmin per 256
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        scmn = rng.integers(0, 64, (n, k // 256 * 8, 2), dtype=np.uint8)
        return P.pack_q4k(q, scmn, (rng.random((n, k // 256, 2)) * 0.01 + 0.001).astype(np.float16))
    if fmt == "q5f":
        q = rng.integers(0, 32, (n, k), dtype=np.uint8)
        d, m = (rng.random((n, nb)) * 0.05 + 0.01).astype(np.float32), (-rng.random((n, nb)) * 0.5).astype(np.float32)
        return P.pack_q5(q, d, m)
    if fmt in ("q4", "q4f"):
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        d = (rng.random((n, nb)) * 0.1 + 0.01).astype(np.float16 if fmt == "q4" else np.float32)
        m = (-rng.random((n, nb)) * 0.5).astype(d.dtype)
        return P.pack_q4(q, d, m)
    q = rng.integers(-127, 128, (n, k), dtype=np.int16).astype(np.int8)
    d = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float16)
    oscale = (rng.random(n) + 0.5).astype(np.float32) if fmt == "int8_oscale" else None
    return P.pack_q8(q, d, oscale)


FORMATS = ("q4", "q4f", "q8", "int8_oscale", "q6", "q5f")
#: Input width per format: 10 blocks (an uneven count), or 2 Q6_K super-blocks.
K_OF = {"q6": 512}


@_no_qgemm
@pytest.mark.parametrize("isa,act", _isa_act_params())
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_matmul_is_row_wise(fmt, isa, act):
    """80 outputs (5 groups: an uneven split over 2 threads) x K = 320; up to 300 rows cross every threshold of
    ``kvserve_qgemm`` (SERIAL_MACS, SERIAL_QUANT, STACK_BYTES, AMX_ROWS; row chunks: the next test). Both the kernel entry point and
    the layer the model calls (``QuantLinear``), which must agree."""
    k = K_OF.get(fmt, 320)
    packed = _packed(fmt, 80, k)
    layer = QuantLinear(packed, fmt, isa=isa, activations=act)
    assert layer.path.startswith(f"{fmt}/{isa}")
    x = _x(300, k)
    assert_row_invariant(lambda idx: qk.qgemm(x[idx], packed, isa, act), 300)
    assert_row_invariant(lambda idx: layer(x[idx]), 300, rows=(1, 16, 300), threads=(2,))
    assert torch.equal(layer(x), qk.qgemm(x, packed, isa, act))


@_no_qgemm
@pytest.mark.parametrize("act", ["int8", "int8x2"])  # bf16 has no VNNI counterpart (tests/model/test_bf16_kernels.py)
@pytest.mark.skipif(not (qk.cpu_supports("amx_int8") and qk.cpu_supports("avx512_vnni")),
                    reason="CPU lacks AMX-INT8 (or the OS did not grant it) or AVX-512 VNNI")
def test_amx_rows_equal_vnni_rows_at_every_batch_size(act):
    """The AMX path runs rows on the VNNI tiles below 16 rows and past the last full 16-row tile of each 32-row
    chunk, on AMX tiles elsewhere: both give the same bits, so switching path by M never changes a row."""
    for fmt in FORMATS:
        k = K_OF.get(fmt, 320)
        x = _x(300, k, seed=4)
        packed = _packed(fmt, 80, k)
        for m in ROWS + (17, 31, 33, 48):
            assert torch.equal(qk.qgemm(x[:m], packed, "amx_int8", act), qk.qgemm(x[:m], packed, "avx512_vnni", act)), \
                (fmt, m)


#: Row counts of the many-row checks: partial and whole row tiles (4, 6, 16 rows) and their tails, several row chunks.
MANY_ROWS = (1, 2, 15, 16, 17, 31, 64, 97, 300)


@_no_qgemm
@pytest.mark.parametrize("isa,act", _isa_act_params())
@pytest.mark.parametrize("fmt", FORMATS + ("q4k",))
def test_many_rows_in_row_chunks_equal_single_rows(fmt, isa, act):
    """K = 8192: rows of 8 KiB (int8) or 16 KiB (int8x2) of quantized activations, so a call of 300 rows passes over
    the weights in 3 or 5 row chunks (``rows_per_chunk``: 1 MiB each), the last with a tail on the VNNI tiles under
    AMX; every row of every ``MANY_ROWS`` call equals the row computed alone, bit for bit, on 1 and 2 threads.
    32 outputs: one group per thread."""
    k = 8192
    packed = _packed(fmt, 32, k)
    x = _x(300, k, seed=12)
    assert_row_invariant(lambda idx: qk.qgemm(x[idx], packed, isa, act), 300, rows=MANY_ROWS)


@_no_qgemm
@pytest.mark.parametrize("isa", _isa_params())
def test_padded_int8_layer_is_row_wise(isa):
    """``quantization="int8"`` of a float weight whose sizes are not multiples of the layout's (72 x 300: padded
    outputs, zero-padded inputs in Python) through ``make_linear_method``, the model's factory."""
    w = torch.randn(72, 300, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = make_linear_method(w, "int8", qk.QuantPath(isa, qk.DEFAULT_ACTIVATIONS[isa]))
    x = _x(300, 300, seed=6)
    assert_row_invariant(lambda idx: layer(x[idx]), 300)


# ------------------------------------------------------------------------------------------------ float32 matmul


@_no_cpu_kernels
def test_float32_matmul_is_row_wise():
    """``quantization="fp32"``'s projections: kvserve's AVX2 kernel (6-row register blocks, 16-feature panels; 72
    outputs: a padded last panel) through ``Linear``, its default path where the library loads."""
    w = torch.randn(72, 200, generator=torch.Generator().manual_seed(7))
    layer = Linear(w)
    assert layer.path == "kvserve"
    x = _x(300, 200, seed=8)
    assert_row_invariant(lambda idx: layer(x[idx]), 300)


@_no_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_weight_matmul_is_row_wise(dtype):
    """GGUF F16 / BF16 weights kept in 16 bits (``linear_16bit``): row-wise, and each row's bits equal the float32
    kernel's on the widened weight."""
    from kvserve.layers.linear import linear_16bit

    w = (torch.randn(72, 200, generator=torch.Generator().manual_seed(7)) * 0.1).to(dtype)
    layer = linear_16bit(w)
    assert layer.path == f"{'bf16' if dtype == torch.bfloat16 else 'f16'}/kvserve"
    x = _x(300, 200, seed=8)
    assert_row_invariant(lambda idx: layer(x[idx]), 300)
    assert torch.equal(layer(x), cpu_kernels.gemm(x, cpu_kernels.pack(w.float()), 72))


# ------------------------------------------------------------------------------------------------ element-wise


def _ops():
    return [pytest.param(TorchOps(), id="torch"),
            pytest.param(CPUKernelOps(), id="cpu-kernels", marks=_no_cpu_kernels)]


@pytest.mark.parametrize("ops", _ops())
def test_norms_and_silu_mul_are_row_wise(ops):
    """RMSNorm, the residual add + RMSNorm (in place: a fresh copy per call) and silu(gate) * up at this model's
    widths (hidden 576, intermediate 1536); 300 rows pass the kernels' parallel threshold (65536 values)."""
    g = torch.Generator().manual_seed(9)
    h, delta = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    gate_up = torch.randn(300, 2 * 1536, generator=g) * 4
    assert_row_invariant(lambda idx: ops.rms_norm(h[idx], w, 1e-5), 300)

    def add_norm(idx):
        new_h, y = ops.add_rms_norm(h[idx].clone(), delta[idx], w, 1e-5)
        return torch.cat([new_h, y], dim=1)

    assert_row_invariant(add_norm, 300)
    assert_row_invariant(lambda idx: ops.silu_mul(gate_up[idx]), 300)


# ---------------------------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_rows_do_not_depend_on_the_batch_or_the_table_size(head_dim):
    """A position's cos/sin are the same bits computed alone, in any batch of positions, from a table of any size
    (``RopeTable`` grows with the longest context seen, so its size depends on the engine's history), on 1 or 2
    threads; ``apply_rotary`` (the PyTorch rotation) is row-wise too."""
    inv = rope_inv_freq(head_dim, 100000.0)
    positions = torch.randint(0, 70000, (300,), generator=torch.Generator().manual_seed(10))
    positions[:3] = torch.tensor([0, 255, 256])

    def direct(idx):
        cos, sin = rope_cos_sin(positions[idx], inv, torch.float32)
        return torch.cat([cos, sin], dim=-1)

    assert_row_invariant(direct, 300)
    with _threads(1):
        ref = _alone(direct, 300)
    for t in THREADS:
        with _threads(t):
            for end in (70000, 140001):
                table = RopeTable(inv, torch.float32)
                table(torch.tensor([0]), 1)  # the smallest table first: it then grows by doubling
                cos, sin = table(positions, end)
                assert torch.equal(torch.cat([cos, sin], dim=-1), ref), (t, end)
    x = torch.randn(300, 3, head_dim, generator=torch.Generator().manual_seed(11))
    cos_sin = ref

    def rotate(idx):
        c, s = cos_sin[idx].split(head_dim, dim=-1)
        return apply_rotary(x[idx], c, s)

    assert_row_invariant(rotate, 300)


# ------------------------------------------------------------------------------------------------------- sampler

VOCAB = 49152  # this model's vocabulary: single-row reductions over it are long enough for PyTorch to split them
SAMPLER_ROWS = (1, 2, 5, 16)
SAMPLER_N = 16  # rows of logits in the sampler tests
SAMPLING = {
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),  # flat rows: the candidate window widens, up to V
    "top_k": SamplingParams(temperature=1.0, top_k=50),
    "top_k_large": SamplingParams(temperature=1.0, top_k=600),  # three 256-candidate chunks
    "top_k_top_p_min_p": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.05),
    "min_p": SamplingParams(temperature=1.2, min_p=0.02),
}


def _logits(n: int = SAMPLER_N, seed: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    logits[1, :40] += 12.0  # a peaked row: the nucleus closes early ...
    logits[1, 0] = logits[1].max() + 1.0  # ... and token 0 is its most likely token
    logits[2] *= 0.1  # a flat row: the nucleus needs most of the vocabulary
    return logits


@pytest.mark.parametrize("name", list(SAMPLING))
def test_filtered_distribution_of_a_row_is_row_wise(name):
    """The distribution a row samples from (``nucleus.probabilities``, speculative verification's target) and the
    token an inverse-transform draw takes from it, with every row's own uniform."""
    params = SAMPLING[name]
    logits = _logits()
    uniforms = torch.rand(SAMPLER_N, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    assert_row_invariant(lambda idx: nucleus.probabilities(logits[idx], [params] * len(idx)), SAMPLER_N,
                         SAMPLER_ROWS)
    assert_row_invariant(lambda idx: nucleus.sample(logits[idx], [params] * len(idx), uniforms[idx]), SAMPLER_N,
                         SAMPLER_ROWS)


def test_filtered_distribution_does_not_depend_on_other_rows_parameters():
    """The first candidate window is as wide as the batch's largest ``top_k``, and rows without top-k / top-p go
    apart: a row's distribution must not change with its neighbours' parameters."""
    logits = _logits()
    names = list(SAMPLING)
    mixed = [SAMPLING[names[i % len(names)]] for i in range(SAMPLER_N)]
    others = [SamplingParams(temperature=1.0, top_k=3000), SamplingParams(temperature=0.5, top_p=0.999),
              SamplingParams(temperature=0.6)]
    for i in range(len(names)):  # one row of each kind
        alone = nucleus.probabilities(logits[i: i + 1], [mixed[i]])
        for other in others:
            batch = nucleus.probabilities(logits[[i, i + 1]], [mixed[i], other])
            _assert_equal_rows(batch[:1], alone, f"row {i} ({mixed[i]}) next to {other}")
    assert_row_invariant(lambda idx: nucleus.probabilities(logits[idx], [mixed[i] for i in idx.tolist()]), SAMPLER_N,
                         SAMPLER_ROWS)


def _states(idx, params):
    return [SamplingState(f"r{i}", params[i], [1, 2, 3], [], torch.Generator().manual_seed(100 + i))
            for i in idx.tolist()]


def test_sampler_logprobs_and_seeded_tokens_are_row_wise():
    """``Sampler``: a row's logprobs (log-softmax of the raw logits, top 5 and the sampled token's) and its seeded
    token are the same whether 1 or many rows are sampled in the step, greedy and sampled rows mixed."""
    logits = _logits()
    names = list(SAMPLING)
    params = [SamplingParams(temperature=0.0, logprobs=5) if i % 3 == 0 else
              SamplingParams(**{**_kwargs(SAMPLING[names[i % len(names)]]), "seed": i, "logprobs": 5})
              for i in range(SAMPLER_N)]
    sampler = Sampler()

    def step(idx):
        tokens, logprobs = sampler(logits[idx], _states(idx, params))
        rows = []
        for t, lp in zip(tokens, logprobs):  # the token, its logprob, then the top 5 (the token may be one of them)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:5]
            rows.append([float(t), lp[t]] + [v for kv in top for v in kv])
        return torch.tensor(rows, dtype=torch.float64)

    assert_row_invariant(step, SAMPLER_N, SAMPLER_ROWS)


def _kwargs(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
