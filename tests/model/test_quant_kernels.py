"""kvserve's quantized matmul (csrc/qgemm.c through kvserve.layers.quant_linear): every weight format on every ISA path the
CPU has (forced as the engine's cpu_isa forces it), at partial row tiles and output groups, against float64
references.

Two references per case:
- exact-activation: the activations quantized exactly as the kernel does (the numpy quantizer equals the C one bit
  for bit, tested below), then a float64 product: the kernel may differ only by float32 summation order, so the
  bound is 1e-5 of sum |w| |x|;
- float64 from the dequantized weights and the unrounded activations: the kernel's activation rounding moves each x
  by at most d_x / 2 (d_x = its block's max|x| / 127 with int8 activations, 254 times less with the int8 pair), so
  |error| <= sum_k |w_k| d_x(k) / 2 (+ the above).

Every path runs with both integer activation quantizations (``INT8_ACTS``; bf16: tests/model/test_bf16_kernels.py).
"""

import ctypes

import numpy as np
import pytest
import torch

import gguf
from kvserve.config import KernelConfig
from kvserve.kernels import qgemm as kernels
from kvserve.layers.quant_linear import make_linear_method
from kvserve.quant import QuantTensor, formats
from kvserve.quant import pack as P
from kvserve.layers.quant_linear import ConcatLinear, QuantLinear, unpack, unpack_rows

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=str(kernels.unavailable_reason()))

ROWS = (1, 3, 7, 16, 17, 64, 129)
#: The integer activations, run on every path here; ``"bf16"`` (AMX-BF16 only) has tests/model/test_bf16_kernels.py.
INT8_ACTS = ("int8", "int8x2")


def _isa_params():
    return [pytest.param((name, act), id=f"{name}-{act}",
                         marks=pytest.mark.skipif(not kernels.cpu_supports(name), reason=f"CPU lacks {name}"))
            for name in kernels.ISAS for act in INT8_ACTS]


_CURRENT = {"activations": "int8"}


@pytest.fixture(params=_isa_params())
def isa(request, monkeypatch):
    """Each ISA path with each activation quantization, chosen as the engine's ``KernelConfig`` (``cpu_isa``,
    ``quant_activations``) chooses them: the layers built without an explicit path get this one."""
    name, act = request.param
    path = kernels.choose_path(True, name, act)
    assert path == kernels.QuantPath(name, act)
    monkeypatch.setattr(kernels, "default_path", lambda: path)
    monkeypatch.setattr(kernels, "isa", lambda: name)
    monkeypatch.setitem(_CURRENT, "activations", act)
    yield name


def _path(kind, isa):
    """``QuantLinear.path`` of a ``kind`` layer on path ``isa`` with the current activations."""
    return f"{kind}/{isa}{'+a16' if _CURRENT['activations'] == 'int8x2' else ''}"


def _gguf_tensor(qtype, n, k, seed):
    rng = np.random.default_rng(seed)
    if qtype in (formats.Q4_0, formats.Q4_1, formats.Q8_0, formats.Q5_0, formats.Q5_1, formats.MXFP4):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0] = 0.0  # an all-zero row: zero scales
        w[1, :32] = np.linspace(-1, 3, 32)  # an outlier block
        raw = gguf.quants.quantize(w, qtype)
    else:  # K-quants: gguf cannot quantize them; random blocks with finite float16 scales
        bs, tb = formats.block_size(qtype)
        raw = rng.integers(0, 256, (n, k // bs, tb), dtype=np.uint8)
        scale_at = {formats.Q4_K: [0, 2], formats.Q5_K: [0, 2], formats.Q6_K: [208], formats.IQ4_NL: [0],
                    formats.Q3_K: [108], formats.Q2_K: [80, 82]}[qtype]
        for off in scale_at:
            raw[..., off:off + 2] = (rng.random((n, k // bs)) * 0.01).astype("<f2")[..., None].view(np.uint8)
        raw = raw.reshape(n, -1)
    return QuantTensor("w", qtype, raw, (n, k))


def _check(layer, x, w64):
    got = layer(torch.from_numpy(x)).numpy().astype(np.float64)
    assert got.shape == (x.shape[0], w64.shape[0])
    k = w64.shape[1]
    k_pad = -(-k // 32) * 32
    xp = np.pad(x, ((0, 0), (0, k_pad - k)))
    exact_act = kernels.reference_qgemm(xp, np.pad(w64, ((0, 0), (0, k_pad - k))), layer.activations)
    mag = np.abs(x).astype(np.float64) @ np.abs(w64).T + 1e-30
    assert np.all(np.abs(got - exact_act) <= 1e-5 * mag)
    _, d, _ = kernels.quantize_activations(xp, layer.activations)
    dx = np.repeat(d.astype(np.float64), 32, axis=1)[:, :k]  # per element: its block's step
    bound = (dx / 2) @ np.abs(w64).T
    err = np.abs(got - x.astype(np.float64) @ w64.T)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-5 * mag)


def _check_file_values(layer, t, rows):
    """``layer`` holds ``t``'s values: its packed weight decodes (numpy, and C on three rows) to
    ``gguf.quants.dequantize`` bit for bit, and ``rows`` random rows multiply within ``_check``'s bounds."""
    n, k = t.shape
    w = gguf.quants.dequantize(t.raw, t.qtype).reshape(n, k)
    np.testing.assert_array_equal(layer.dequantized().view(np.uint32), w.view(np.uint32))
    rows_at = np.array([0, n // 2, n - 1], np.int64)
    out = np.empty((3, k), np.float32)
    assert kernels.load().kvserve_q_unpack_rows(layer.packed.fmt, layer.packed.data.data_ptr(), n, k, None,
                                                rows_at.ctypes.data, 3, out.ctypes.data) == 0
    np.testing.assert_array_equal(out.view(np.uint32), w[rows_at].view(np.uint32))
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    x[0, 7] = 25.0
    _check(layer, x, w.astype(np.float64))


@pytest.mark.parametrize("qtype,n,k", [(formats.Q4_0, 40, 96), (formats.Q4_1, 40, 96), (formats.Q8_0, 40, 96),
                                       (formats.Q4_1, 48, 288), (formats.Q8_0, 16, 288)])
@pytest.mark.parametrize("rows", ROWS)
def test_gguf_formats_match_float64_reference(isa, qtype, n, k, rows):
    t = _gguf_tensor(qtype, n, k, seed=rows)
    layer = make_linear_method(t, "auto")
    assert layer.path == _path("q4" if qtype != formats.Q8_0 else "q8", isa)
    w = t.dequantize()
    np.testing.assert_array_equal(layer.dequantized(), w)  # the packed weight is the file's, exactly
    x = np.random.default_rng(100 + rows).standard_normal((rows, k)).astype(np.float32)
    x[0, 5] = 30.0  # a large activation in one block
    _check(layer, x, w.astype(np.float64))


@pytest.mark.parametrize("rows", ROWS)
def test_q4_k_kept_exactly(isa, rows):
    """Q4_K: the file's nibbles, 6-bit sub-block scales and mins and float16 super-block scales (FMT_Q4K, 296 bytes
    a block of 16 x 32: 4.625 bits a weight); the values d * sc and -(dmin * mn) are exact."""
    t = _gguf_tensor(formats.Q4_K, 40, 512, seed=rows)
    layer = make_linear_method(t)
    assert layer.path == _path("q4_k", isa) and layer.packed.fmt == P.FMT_Q4K
    assert layer.packed.data.numel() == 3 * (512 // 32) * 296
    w = t.dequantize()
    np.testing.assert_array_equal(layer.dequantized(), w)
    q, d, m = formats.decode_q4_k(t.raw, 512)
    np.testing.assert_array_equal((np.repeat(d, 32, 1) * q + np.repeat(m, 32, 1)).view(np.uint32), w.view(np.uint32))
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    _check(layer, x, w.astype(np.float64))


K_FORMATS = {formats.Q6_K: ("q6_k", P.FMT_Q6), formats.Q5_K: ("q5_k", P.FMT_Q5F), formats.Q4_K: ("q4_k", P.FMT_Q4K),
             formats.Q2_K: ("q2_k", P.FMT_Q2K)}


@pytest.mark.parametrize("qtype", list(K_FORMATS))
@pytest.mark.parametrize("n,k", [(40, 512), (33, 256), (16, 768)])
@pytest.mark.parametrize("rows", ROWS)
def test_k_quants_kept_exactly(isa, qtype, n, k, rows):
    """Q6_K, Q5_K, Q4_K and Q2_K on their own kernels: the file's 6-bit values, int8 sub-block scales and float16 d
    (FMT_Q6), 5-bit values with float32 sub-block scales and mins (FMT_Q5F), or Q4_K's or Q2_K's stored parts (FMT_Q4K,
    FMT_Q2K), decoding to ``gguf.quants.dequantize`` bit for bit (in Python and in C), and the product within the
    activation rounding of a float64 matmul with those weights; 33 outputs: a padded last group."""
    t = _gguf_tensor(qtype, n, k, seed=rows)
    layer = make_linear_method(t)
    kind, fmt = K_FORMATS[qtype]
    assert layer.path == _path(kind, isa) and layer.packed.fmt == fmt
    _check_file_values(layer, t, rows)


NEW_FORMATS = {formats.Q3_K: ("q3_k", P.FMT_Q3K, 3.5625), formats.MXFP4: ("mxfp4", P.FMT_MX4, 4.25)}


@pytest.mark.parametrize("qtype", list(NEW_FORMATS))
@pytest.mark.parametrize("n,k", [(40, 512), (33, 256), (16, 2880)])
@pytest.mark.parametrize("rows", ROWS)
def test_q3_k_and_mxfp4_kept_exactly(isa, qtype, n, k, rows):
    """Q3_K in its own 3.5625-bit Q3K layout on the Q6 tiles (its 3-bit values - 4 and signed 6-bit scales kept as
    int8: the same products), MXFP4 in its own 4.25-bit MX4 layout (E2M1 codes and E8M0 exponents): the packed
    weight decodes to ``gguf.quants.dequantize`` bit for bit (numpy and C), the product is within the activation
    rounding of a float64 matmul; K = 2880 is gpt-oss's hidden size (not a multiple of 256: MXFP4 only)."""
    if qtype == formats.Q3_K and k % 256:
        k = 2816
    t = _gguf_tensor(qtype, n, k, seed=rows)
    layer = make_linear_method(t)
    kind, fmt, bits = NEW_FORMATS[qtype]
    assert layer.path == _path(kind, isa) and layer.packed.fmt == fmt
    assert layer.packed.data.numel() * 8 == -(-n // 16) * 16 * k * bits  # MX4: the file's; Q3K: 1/8 bit more
    _check_file_values(layer, t, rows)


def test_mxfp4_exponents_outside_float16_are_refused():
    """The kernels expand MX4 blocks to Q8 blocks with float16 d = 2^(e - 128): a non-zero block whose exponent has
    no float16 value is refused by name (never silently flushed); an all-zero block's exponent does not matter."""
    codes = np.ones((16, 64), np.uint8)
    e = np.full((16, 2), 120, np.uint8)
    P.pack_mx4(codes, e)
    e[3, 1] = 150
    with pytest.raises(ValueError, match="MXFP4 block exponent 150"):
        P.pack_mx4(codes, e)
    codes[3, 32:] = 8  # code 8 is -0: an all-zero block
    assert P.pack_mx4(codes, e).data.numel() == 2 * 272


def test_mxfp4_from_the_hugging_face_layout():
    """gpt-oss's safetensors ``*_blocks`` / ``*_scales`` decode to the values transformers' own converter gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (2, 24, 3, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, (2, 24, 3), dtype=np.uint8)
    codes, e = formats.decode_mxfp4_hf(blocks, scales)
    assert codes.shape == (2, 24, 96) and e.shape == (2, 24, 3)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales.astype(np.int32)),
                                      dtype=torch.float32).transpose(1, 2).numpy()  # [E, out, in]
    for x in range(2):
        got = unpack(P.pack_mx4(codes[x], e[x]))
        np.testing.assert_array_equal(got, want[x])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 53, 97])
@pytest.mark.parametrize("n,k", [(40, 256), (33, 512), (16, 2048)])
def test_q4_k_compact_blocks_give_the_q4f_bits(isa, n, k, rows):
    """FMT_Q4K forms d * sc and -(dmin * mn) in the kernel: the same floats FMT_Q4F stores, so the same outputs bit
    for bit, on every path, both activations, row counts across the row tiles, the AMX tiles and the Q4F expansion
    of many rows (Q4K_EXPAND_TILES)."""
    t = _gguf_tensor(formats.Q4_K, n, k, seed=rows)
    q, scmn, ddmin = formats.decode_q4_k_parts(t.raw, k)
    compact = P.pack_q4k(q, scmn, ddmin)
    wide = P.pack_q4(*formats.decode_q4_k(t.raw, k))
    assert wide.fmt == P.FMT_Q4F and compact.data.numel() == -(-n // 16) * (k // 32) * 296
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
    for act in INT8_ACTS:
        assert torch.equal(kernels.qgemm(x, compact, isa, act), kernels.qgemm(x, wide, isa, act))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 53, 97])
@pytest.mark.parametrize("n,k", [(40, 256), (33, 512), (16, 2048)])
def test_q3_k_compact_blocks_give_the_q6_bits(isa, n, k, rows):
    """FMT_Q3K (3.5625 bits a weight) runs Q3_K's values on the Q6 tiles: the same outputs bit for bit as the same
    values packed as Q6 blocks (7 bits), on every path, both activations, across row tiles and AMX tiles."""
    t = _gguf_tensor(formats.Q3_K, n, k, seed=rows)
    parts = formats.decode_q3_k(t.raw, k)
    compact, wide = P.pack_q3k(*parts), P.pack_q6(*parts)
    assert compact.fmt == P.FMT_Q3K and compact.data.numel() == -(-n // 16) * (k // 32) * 228
    np.testing.assert_array_equal(unpack(compact).view(np.uint32), unpack(wide).view(np.uint32))
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
    for act in INT8_ACTS:
        assert torch.equal(kernels.qgemm(x, compact, isa, act), kernels.qgemm(x, wide, isa, act))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 53, 97])
@pytest.mark.parametrize("n,k", [(40, 256), (33, 512), (16, 2048)])
def test_q2_k_compact_blocks_equal_the_reference(isa, n, k, rows):
    """FMT_Q2K keeps Q2_K's stored parts (2-bit values, 4-bit scales and mins per 16 inputs, float16 d, dmin per 256:
    the file's 2.625 bits a weight) and its kernels give the exact-activation reference of ``gguf.quants.dequantize``'s
    weights, on every path, both activations, row counts across the row tiles and the AMX tiles."""
    t = _gguf_tensor(formats.Q2_K, n, k, seed=rows)
    layer = make_linear_method(t)
    assert layer.path == _path("q2_k", isa) and layer.packed.fmt == P.FMT_Q2K
    assert layer.packed.data.numel() * 8 == -(-n // 16) * 16 * k * 2.625
    w = gguf.quants.dequantize(t.raw, formats.Q2_K).reshape(n, k)
    np.testing.assert_array_equal(layer.dequantized().view(np.uint32), w.view(np.uint32))
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    x[0, 3] = -25.0
    _check(layer, x, w.astype(np.float64))


@pytest.mark.parametrize("qtype,kind,fmt", [(formats.Q5_0, "q5_0", P.FMT_Q5F), (formats.Q5_1, "q5_1", P.FMT_Q5F),
                                            (formats.IQ4_NL, "iq4_nl", P.FMT_Q8)])
@pytest.mark.parametrize("rows", [1, 7, 17, 64])
def test_q5_0_q5_1_iq4_nl_kept_exactly(isa, qtype, kind, fmt, rows):
    """Q5_0 / Q5_1 on the Q5F blocks (float32 ``d``, ``m = -16 d`` / the file's ``m``), IQ4_NL's grid values on the
    Q8 blocks: the file's values (equal to ``gguf.quants.dequantize``), no float32 copy."""
    t = _gguf_tensor(qtype, 40, 288, seed=rows)
    layer = make_linear_method(t)
    assert layer.path == _path(kind, isa) and layer.packed.fmt == fmt
    w = gguf.quants.dequantize(t.raw, qtype).reshape(40, 288)
    np.testing.assert_array_equal(layer.dequantized(), w)
    np.testing.assert_array_equal(t.dequantize().view(np.uint32), w.view(np.uint32))
    x = np.random.default_rng(rows).standard_normal((rows, 288)).astype(np.float32)
    _check(layer, x, w.astype(np.float64))


@pytest.mark.parametrize("qtype", [formats.F16, formats.BF16])
def test_16bit_gguf_weights_stay_16bit(qtype):
    """GGUF F16 / BF16 weights (and a fused list of them) on kvserve's matmul with the 16 bits kept: the outputs equal
    the float32 kernel's on ``gguf.quants.dequantize``'s values, bit for bit; ``"fp32"`` and ``"int8"`` still take
    them; mixed with a block format: a ``ConcatLinear``."""
    from kvserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((40, 96)) * 0.1).astype(np.float32)
    raw = np.ascontiguousarray(w.astype(np.float16)).view(np.uint8) if qtype == formats.F16 else \
        (w.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    parts = [QuantTensor("a", qtype, raw[:24], (24, 96)), QuantTensor("b", qtype, raw[24:], (16, 96))]
    ref = gguf.quants.dequantize(raw, qtype).reshape(40, 96)
    np.testing.assert_array_equal(np.concatenate([p.dequantize() for p in parts]), ref)
    layer = make_linear_method(parts)
    assert layer.path == f"{qtype.name.lower()}/kvserve" and layer.packed.dtype != torch.float32
    x = torch.from_numpy(rng.standard_normal((7, 96)).astype(np.float32))
    assert torch.equal(layer(x), cpu_kernels.gemm(x, cpu_kernels.pack(torch.from_numpy(ref)), 40))
    torch.testing.assert_close(make_linear_method(parts, "fp32")(x), x @ torch.from_numpy(ref).T, rtol=1e-5,
                               atol=1e-5)
    assert make_linear_method(parts, "int8").path.startswith("int8/")
    mixed = make_linear_method([parts[0], _gguf_tensor(formats.Q8_0, 16, 96, 1)])
    assert isinstance(mixed, ConcatLinear) and mixed.parts[0].path == layer.path


def test_q6_k_extreme_blocks_do_not_overflow(isa):
    """The largest integer sums a Q6 block can make (q - 32 = -32, sub-block scale -128, activations at +-127,
    both halves; 254 a1 + a2 would pass 2^31 in int32): still within the bound."""
    n, k = 16, 256
    q = np.zeros((n, k), np.uint8)
    q[1::2] = 63
    sc = np.full((n, k // 16), -128, np.int8)
    d = np.full((n, 1), 0.01, np.float16)
    layer = QuantLinear(P.pack_q6(q, sc, d), "q6_k")
    w = unpack(layer.packed).astype(np.float64)
    x = np.ones((3, k), np.float32)
    x[1] = -1
    x[2, ::2] = -1
    _check(layer, x, w)


def test_fused_k_quant_projection_mixes_formats():
    """A Q4_K_M file's attention: Q4_K q/k with a Q6_K v (and a Q5_K part): one layer per format, outputs in order;
    parts of one format (two Q6_K) are packed together."""
    parts = [_gguf_tensor(formats.Q4_K, 32, 256, 1), _gguf_tensor(formats.Q6_K, 16, 256, 2),
             _gguf_tensor(formats.Q5_K, 16, 256, 3)]
    layer = make_linear_method(parts)
    assert isinstance(layer, ConcatLinear) and [p.path.split("/")[0] for p in layer.parts] == ["q4_k", "q6_k", "q5_k"]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), torch.cat([make_linear_method(p)(x) for p in parts], dim=1), rtol=0, atol=0)
    both = make_linear_method(parts[1:2] * 2)
    assert isinstance(both, QuantLinear) and both.packed.fmt == P.FMT_Q6 and both.out_features == 32
    np.testing.assert_array_equal(both.dequantized(), np.concatenate([parts[1].dequantize()] * 2))


@pytest.mark.parametrize("n,k", [(40, 96), (33, 100)])  # 100: not a multiple of 32, zero-padded inside
@pytest.mark.parametrize("rows", ROWS)
def test_int8_per_block_from_float(isa, n, k, rows):
    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((n, k)) * np.linspace(0.01, 1, n)[:, None]).astype(np.float32)
    layer = make_linear_method(torch.from_numpy(w), "int8")
    assert (layer.path, layer.out_features, layer.in_features) == (_path("int8", isa), n, k)
    held = layer.dequantized().astype(np.float64)
    wp = np.pad(w, ((0, 0), (0, -k % 32)))
    step = np.repeat(np.abs(wp).reshape(n, -1, 32).max(-1) / 127, 32, axis=1)[:, :k]
    assert np.all(np.abs(held - w) <= step * 0.51)  # per 32-block rounding: half a step (+ its float16 rounding)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    _check(layer, x, held)


def test_int8_of_a_gguf_tensor_and_fp32_method():
    t = _gguf_tensor(formats.Q4_1, 32, 64, seed=3)
    i8 = make_linear_method(t, "int8")
    assert i8.path.startswith("int8/")
    f32 = make_linear_method(t, "fp32")
    assert f32.path in ("kvserve", "onednn", "mkl")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ torch.from_numpy(t.dequantize()).double().T
    torch.testing.assert_close(f32(x).double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act", INT8_ACTS)
@pytest.mark.parametrize("isa_id", [0, 1])  # 0: the scalar C loop, 1: the AVX2 one the matmul uses
def test_activation_quantizer_equals_numpy_reference(isa_id, act):
    if isa_id and not kernels.cpu_supports("avx2"):
        pytest.skip("CPU lacks avx2")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 128)).astype(np.float32) * 3
    x[1, :32] = 0.0  # all-zero block: scale 0, all q 0
    x[2, :32] = np.concatenate([[127.0], np.arange(31) - 15.5])  # scale exactly 1: ties +-0.5, 1.5, ... to even
    x[4, 64] = 1e30
    x[3, 32:64] = np.linspace(-2, 2, 32) * np.float32(1 + 2 ** -20)  # residuals near the int8 pair's ties
    m, k = x.shape
    pair = act == "int8x2"
    q = np.empty((m, k // 32, 2 if pair else 1, 32), np.int8)  # the pair: per block q1[32] then q2[32]
    d = np.empty((m, k // 32), np.float32)
    s = np.empty((m, k // 32), np.float32)
    kernels.load().kvserve_q_quantize_rows(isa_id, kernels.ACTIVATIONS[act], x.ctypes.data, m, k, q.ctypes.data,
                                           d.ctypes.data, s.ctypes.data)
    q_ref, d_ref, s_ref = kernels.quantize_activations(x, act)
    got = q[:, :, 0].astype(np.int32) * 254 + q[:, :, 1] if pair else q
    np.testing.assert_array_equal(got.reshape(m, k), q_ref)
    if pair:  # each half is an int8 in -127..127 and the pair's step is the int8 step / 254
        assert np.abs(q).max() <= 127
        np.testing.assert_array_equal(d * np.float32(254), kernels.quantize_activations(x, "int8")[1])
    np.testing.assert_array_equal(d.view(np.uint32), d_ref.view(np.uint32))
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))


def test_pack_round_trip_is_exact():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (37, 64), dtype=np.uint8)
    d, m = (rng.standard_normal((37, 2)).astype(np.float16) for _ in range(2))
    w = P.pack_q4(q, d, m)
    assert tuple(w.data.shape) == (3, 2, P.Q4_BLOCK)
    np.testing.assert_array_equal(unpack(w), np.repeat(d.astype(np.float32), 32, 1) * q + np.repeat(
        m.astype(np.float32), 32, 1))
    q8 = rng.integers(-128, 128, (17, 96)).astype(np.int8)
    w8 = P.pack_q8(q8, d[:17, :1].repeat(3, 1))
    np.testing.assert_array_equal(unpack(w8), q8 * np.repeat(d[:17, :1].astype(np.float32), 96, 1))


def test_unpack_rows_decode_the_packed_values():
    """unpack_rows (numpy) and kvserve_q_unpack_rows (C) against the values packed, bit for bit, in all four formats."""
    rng = np.random.default_rng(2)
    q4, q8 = rng.integers(0, 16, (37, 96), dtype=np.uint8), rng.integers(-127, 128, (37, 96)).astype(np.int8)
    d, m = (rng.standard_normal((37, 3)).astype(np.float16) for _ in range(2))
    osc = rng.random(37).astype(np.float32)
    wide = (lambda a: np.repeat(a.astype(np.float32), 32, 1))
    cases = [(P.pack_q4(q4, d, m), wide(d) * q4 + wide(m)),
             (P.pack_q4(q4, d.astype(np.float32), m.astype(np.float32)), wide(d) * q4 + wide(m)),
             (P.pack_q8(q8, d), q8 * wide(d)), (P.pack_q8(q8, d, osc), q8 * wide(d) * osc[:, None])]
    rows = np.array([36, 0, 15, 16, 17, 5, 5, 32])  # both ends, each side of a group of 16, the padded last group
    lib = kernels.load() if kernels.isa() is not None else None
    for w, full in cases:
        expected = full.astype(np.float32)[rows]
        np.testing.assert_array_equal(unpack_rows(w, rows).view(np.uint32), expected.view(np.uint32))
        assert unpack_rows(w, rows[:0]).shape == (0, 96)
        with pytest.raises(IndexError, match=r"\[0, 37\)"):
            unpack_rows(w, np.array([37]))
        if lib is not None:  # the C decoder (QuantEmbedding's), bit for bit the same
            out, r = np.full((len(rows), 96), np.nan, np.float32), np.ascontiguousarray(rows)
            os_ptr = None if w.oscale is None else w.oscale.data_ptr()
            assert lib.kvserve_q_unpack_rows(w.fmt, w.data.data_ptr(), 37, 96, os_ptr, r.ctypes.data, len(r),
                                             out.ctypes.data) == 0
            np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
            bad = np.array([3, 37])  # a row past the end: refused before anything is written
            assert lib.kvserve_q_unpack_rows(w.fmt, w.data.data_ptr(), 37, 96, os_ptr, bad.ctypes.data, 2,
                                             out.ctypes.data) == -2
            np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_bad_quantization_is_a_value_error_naming_field_and_values():
    w = torch.randn(16, 32)
    for bad in ("int4", "Q4_1", "", 8):
        with pytest.raises(ValueError, match=r"quantization must be one of 'auto', 'fp32', 'int8'"):
            make_linear_method(w, bad)
    with pytest.raises(ValueError, match="2-D"):
        make_linear_method(torch.randn(4), "int8")


def test_cpu_isa_rejects_unknown_and_unsupported(monkeypatch):
    with pytest.raises(ValueError, match=r"cpu_isa must be one of"):
        kernels.choose_path(True, "sse2")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "sse2")  # the variable is the field's default, checked the same way
    with pytest.raises(ValueError, match=r"cpu_isa \(from \$KVSERVE_CPU_ISA\) must be one of"):
        KernelConfig()
    missing = [n for n in kernels.ISAS if not kernels.cpu_supports(n)]
    if missing:
        with pytest.raises(ValueError, match="does not support"):
            kernels.choose_path(True, missing[0])


def test_kernel_refuses_bad_arguments():
    lib = kernels.load()
    x = torch.randn(2, 40)
    y = torch.empty(2, 16)
    w = torch.zeros(1, 2, P.Q4_BLOCK, dtype=torch.uint8)
    # K = 40 is not a multiple of 32; fmt 7 does not exist; isa 9 does not exist; activations 5 do not exist
    for fmt, isa_id, act, k in ((0, 1, 0, 40), (7, 1, 0, 32), (0, 9, 0, 32), (0, 1, 5, 32)):
        rc = lib.kvserve_qgemm(fmt, isa_id, act, x.data_ptr(), 2, k, w.data_ptr(), 16, None, y.data_ptr(), 16)
        assert rc == -1


def test_bad_activations_are_a_value_error_naming_the_field(monkeypatch):
    with pytest.raises(ValueError, match=r"quant_activations must be one of 'int8', 'int8x2', 'bf16', got 'int4'"):
        kernels.choose_path(True, "auto", "int4")
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match=r"quant_activations \(from \$KVSERVE_QUANT_ACTIVATIONS\) must be one of"):
        KernelConfig()
    with pytest.raises(ValueError, match=r"activations must be one of 'int8', 'int8x2'"):
        QuantLinear(P.pack_q4(np.zeros((16, 32), np.uint8), np.ones((16, 1), np.float16),
                              np.zeros((16, 1), np.float16)), "q4", activations="fp16")


def test_default_activations_follow_the_path():
    assert kernels.choose_path().activations == kernels.DEFAULT_ACTIVATIONS.get(kernels.isa(), "int8")
    assert kernels.choose_path(False) == kernels.QuantPath(None, "int8")  # cpu_kernels=False: no kernel path
    assert kernels.DEFAULT_ACTIVATIONS == {"amx_int8": "int8", "avx512_vnni": "int8", "avx2": "int8"}


def test_fallback_without_kernels_computes_the_same(monkeypatch):
    t = _gguf_tensor(formats.Q4_1, 32, 64, seed=5)
    layer = make_linear_method(t, path=kernels.QuantPath(None))
    assert isinstance(layer, QuantLinear) and layer.path == "q4/fp32_fallback"
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ torch.from_numpy(t.dequantize()).double().T
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-4, atol=1e-5)


def test_c_library_builds_without_isa_flags():
    assert not any(f.startswith(("-m", "-march")) for f in kernels._FLAGS)
    assert isinstance(kernels.load(), ctypes.CDLL)


@pytest.mark.parametrize("quantization", ["auto", "int8", "fp32"])
def test_fused_projection_packs_parts_together(quantization):
    """q/k/v (or gate/up) as one layer: rows stacked in order, like torch.cat of the weights."""
    parts = [_gguf_tensor(formats.Q4_1, 48, 96, 1), _gguf_tensor(formats.Q4_0, 16, 96, 2),
             _gguf_tensor(formats.Q4_1, 16, 96, 3)]
    layer = make_linear_method(parts, quantization)
    assert (layer.out_features, layer.in_features) == (80, 96)
    w = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    if quantization == "fp32":
        np.testing.assert_allclose(layer(torch.from_numpy(x)).numpy(), x @ w.T, rtol=1e-4, atol=1e-4)
        return
    assert isinstance(layer, QuantLinear) and layer.path.split("/")[0] == ("q4" if quantization == "auto" else "int8")
    if quantization == "auto":
        np.testing.assert_array_equal(layer.dequantized(), w)
    _check(layer, x, layer.dequantized().astype(np.float64))


def test_fused_projection_of_mixed_formats_concatenates_outputs():
    parts = [_gguf_tensor(formats.Q4_1, 32, 64, 1), _gguf_tensor(formats.Q8_0, 16, 64, 2)]
    layer = make_linear_method(parts)
    assert isinstance(layer, ConcatLinear) and layer.out_features == 48
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got = layer(x)
    torch.testing.assert_close(got, torch.cat([make_linear_method(p)(x) for p in parts], dim=1))
    with pytest.raises(ValueError, match="in_features"):
        make_linear_method([parts[0], _gguf_tensor(formats.Q4_1, 16, 96, 3)])


def test_non_float32_input_is_converted_not_misread():
    layer = make_linear_method(_gguf_tensor(formats.Q4_1, 16, 64, seed=7))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    torch.testing.assert_close(layer(x), layer(x.float()), rtol=0, atol=0)
    torch.testing.assert_close(layer(x.float().t().contiguous().t()), layer(x.float()), rtol=0, atol=0)  # strided


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """qgemm.c built with SIMDe standing in for AVX-512 and C loops for the AMX tile instructions
    (tests/model/qgemm_amx_emu.c, which includes qgemm_avx512_emu.c): isa 2 and isa 3 run on any x86-64 CPU;
    skipped without SIMDe."""
    import os
    import subprocess
    from pathlib import Path

    src = Path(__file__).with_name("qgemm_amx_emu.c")
    if not Path("/usr/include/simde/x86/avx512.h").exists():
        pytest.skip("SIMDe headers (libsimde-dev) not installed")
    out = tmp_path_factory.mktemp("emu") / "libqgemm_emu.so"
    cc = os.environ.get("CC", "cc")
    proc = subprocess.run([cc, "-O1", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"emulation build failed: {proc.stderr[-300:]}")
    lib = ctypes.CDLL(str(out))
    lib.kvserve_qgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.kvserve_q_isa_supported.argtypes = [ctypes.c_int]
    return lib


def _random_packed(kind, n, k, rng):
    """A random packed weight of ``kind`` (``q4``: float16 scales and mins, ``q4f``: float32 ones, ``q8``, ``int8``:
    q8 with per-output scales, ``q6``: Q6_K's values, k a multiple of 256, ``q5f``: Q5_K's, ``q4k``, ``q2k``: Q4_K's,
    Q2_K's stored parts, ``q3k``: Q3_K's values, k a multiple of 256) ``[n, k]``, and its dequantized float64
    values."""
    nb = k // 32
    if kind in ("q4", "q4f"):
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        dt = np.float16 if kind == "q4" else np.float32
        d, m = (rng.random((n, nb)) * 0.1 + 0.01).astype(dt), (-rng.random((n, nb)) * 0.5).astype(dt)
        packed = P.pack_q4(q, d, m)
    elif kind == "q5f":
        q = rng.integers(0, 32, (n, k), dtype=np.uint8)
        d, m = (rng.random((n, nb)) * 0.05 + 0.01).astype(np.float32), (-rng.random((n, nb)) * 0.5).astype(np.float32)
        packed = P.pack_q5(q, d, m)
    elif kind == "q4k":
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        packed = P.pack_q4k(q, rng.integers(0, 64, (n, nb, 2), dtype=np.uint8),
                            (rng.random((n, k // 256, 2)) * 0.01 + 0.001).astype(np.float16))
    elif kind == "q6":
        q = rng.integers(0, 64, (n, k), dtype=np.uint8)
        sc = rng.integers(-128, 128, (n, k // 16)).astype(np.int8)
        packed = P.pack_q6(q, sc, (rng.random((n, k // 256)) * 0.01 + 0.001).astype(np.float16))
    elif kind == "q3k":
        packed = P.pack_q3k(rng.integers(28, 36, (n, k), dtype=np.uint8), rng.integers(-32, 32, (n, k // 16)).astype(np.int8),
                            (rng.random((n, k // 256)) * 0.01 + 0.001).astype(np.float16))
    elif kind == "q2k":
        q = rng.integers(0, 4, (n, k), dtype=np.uint8)
        packed = P.pack_q2k(q, rng.integers(0, 256, (n, k // 16), dtype=np.uint8),
                            (rng.random((n, k // 256, 2)) * 0.01 + 0.001).astype(np.float16))
    elif kind == "mx4":
        packed = P.pack_mx4(rng.integers(0, 16, (n, k), dtype=np.uint8), rng.integers(104, 144, (n, nb), dtype=np.uint8))
    else:
        q = rng.integers(-128, 128, (n, k)).astype(np.int8)
        d = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float16)
        packed = P.pack_q8(q, d, (rng.random(n) + 0.5).astype(np.float32) if kind == "int8" else None)
    return packed, unpack(packed).astype(np.float64)


def _run(lib, packed, isa_id, act, x):
    """``lib.kvserve_qgemm`` on path ``isa_id`` -> ``[rows, n]`` float32 numpy."""
    rows, k = x.shape
    n_pad = packed.data.shape[0] * 16
    y = torch.empty(rows, n_pad)
    rc = lib.kvserve_qgemm(packed.fmt, isa_id, kernels.ACTIVATIONS[act], torch.from_numpy(x).data_ptr(), rows, k,
                           packed.data.data_ptr(), n_pad,
                           None if packed.oscale is None else packed.oscale.data_ptr(), y.data_ptr(), n_pad)
    assert rc == 0
    return y[:, : packed.out_features].numpy()


EMU_KINDS = ["q4", "q4f", "q8", "int8", "q6", "q5f", "q4k", "mx4", "q2k", "q3k"]


@pytest.mark.parametrize("act", INT8_ACTS)
@pytest.mark.parametrize("kind", EMU_KINDS)
@pytest.mark.parametrize("rows", ROWS)
def test_avx512_vnni_path_logic_under_emulation(emulated, kind, rows, act):
    """The AVX-512 VNNI code (isa 2) run through SIMDe on this CPU: equal to the exact-activation reference."""
    rng = np.random.default_rng(rows)
    k = 256 if kind in ("q6", "q4k", "q2k", "q3k") else 96
    packed, w = _random_packed(kind, 40, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run(emulated, packed, 2, act, x).astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T + 1e-30
    assert np.all(np.abs(got - kernels.reference_qgemm(x, w, act)) <= 1e-5 * mag)


@pytest.mark.skipif(not kernels.cpu_supports("avx512_vnni"), reason="CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("act", INT8_ACTS)
@pytest.mark.parametrize("kind", EMU_KINDS)
def test_emulation_gives_the_native_bits(emulated, kind, act):
    """On a CPU with AVX-512 VNNI: the emulated build's AVX2 and AVX-512 VNNI paths (activation quantizer included)
    give the native library's bits at every row count of ``ROWS``, so the emulation checks the code the CPU runs
    (SIMDe's FMA without a native one rounds twice: the pair quantizer's residual then differs)."""
    lib = kernels.load()
    for rows in ROWS:
        rng = np.random.default_rng(rows)
        k = 256 if kind in ("q6", "q4k", "q2k", "q3k") else 96
        packed, _ = _random_packed(kind, 40, k, rng)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        for isa_id in (1, 2):
            assert np.array_equal(_run(emulated, packed, isa_id, act, x), _run(lib, packed, isa_id, act, x)), (rows, isa_id)


AMX_ROWS = (1, 15, 16, 17, 37, 53, 64, 129)  # below one tile, one, one plus a tail, chunks of 32 with tails


@pytest.mark.parametrize("act", INT8_ACTS)
@pytest.mark.parametrize("kind", EMU_KINDS)
@pytest.mark.parametrize("rows", AMX_ROWS)
def test_amx_path_logic_under_emulation(emulated, kind, rows, act):
    """The AMX-INT8 code (isa 3) with its tile instructions emulated: equal to the exact-activation reference, and
    bit for bit to the (emulated) AVX-512 VNNI path, at 5 output groups (the threads' shares differ in size)."""
    assert emulated.kvserve_q_isa_supported(3) == 1
    rng = np.random.default_rng(100 + rows)
    k = 256 if kind in ("q6", "q4k", "q2k", "q3k") else 128
    packed, w = _random_packed(kind, 72, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :3] = (40.0, -40.0, 0.0)
    got = _run(emulated, packed, 3, act, x)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T + 1e-30
    assert np.all(np.abs(got.astype(np.float64) - kernels.reference_qgemm(x, w, act)) <= 1e-5 * mag)
    assert np.array_equal(got, _run(emulated, packed, 2, act, x))


@pytest.mark.skipif(not kernels.cpu_supports("amx_int8"), reason="CPU lacks AMX-INT8 (or the OS did not grant it)")
@pytest.mark.parametrize("act", INT8_ACTS)
@pytest.mark.parametrize("kind", EMU_KINDS)
def test_amx_equals_avx512_vnni_bit_for_bit(kind, act):
    """On a CPU with AMX: the real tile instructions give the AVX-512 VNNI path's bits, at every row count of
    ``AMX_ROWS`` and at this model's widest layer shape class (K = 1536, 3 row chunks)."""
    lib = kernels.load()
    rng = np.random.default_rng(7)
    for n, k in ((72, 256), (48, 1536)):
        packed, _ = _random_packed(kind, n, k, rng)
        for rows in AMX_ROWS:
            x = rng.standard_normal((rows, k)).astype(np.float32)
            assert np.array_equal(_run(lib, packed, 3, act, x), _run(lib, packed, 2, act, x)), (n, k, rows)


@pytest.mark.parametrize("qtype", [formats.Q4_1, formats.Q8_0, formats.Q4_K, formats.Q6_K, formats.Q5_K, formats.Q3_K,
                                   formats.MXFP4, formats.Q2_K])
def test_a_row_gives_the_same_bits_alone_and_in_any_tile(isa, qtype):
    """Batch invariance of the matmul: a row's output does not depend on the other rows of the call, nor on its
    place in a row tile (1 to 4 or 6 rows; 16-row AMX tiles, their tails and 32-row chunks)."""
    k = 512 if qtype in (formats.Q4_K, formats.Q6_K, formats.Q5_K, formats.Q3_K, formats.Q2_K) else 288
    layer = make_linear_method(_gguf_tensor(qtype, 48, k, seed=11))
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((53, k)).astype(np.float32))
    whole = layer(x)
    for i in (0, 5, 12, 20, 37, 52):
        assert torch.equal(layer(x[i: i + 1]), whole[i: i + 1])
        assert torch.equal(layer(x[i: i + 2])[:1], whole[i: i + 1]) or i == 52
        assert torch.equal(layer(x[i: i + 16])[:1], whole[i: i + 1])  # first row of a full 16-row tile (or fewer)
        assert torch.equal(layer(x[max(0, i - 16): i + 1])[-1:], whole[i: i + 1])  # a tile's tail


def test_tied_q6_k_embedding_decodes_the_heads_bytes():
    """A tied Q6_K embedding (a Q4_K_M file's token_embd) looks rows up from the LM head's packed Q6 bytes, in C
    and in numpy, bit for bit as ``gguf.quants.dequantize``."""
    from kvserve.layers.quant_linear import QuantEmbedding

    if kernels.isa() is None:
        pytest.skip(str(kernels.unavailable_reason()))
    emb = _gguf_tensor(formats.Q6_K, 40, 256, seed=4)
    head = make_linear_method(emb)
    tied = QuantEmbedding(emb, head)
    assert tied.head is head.packed and tied._kernel is not None
    ids = torch.tensor([0, 39, 17, 17])
    want = gguf.quants.dequantize(np.asarray(emb.raw[ids.numpy()]), formats.Q6_K).reshape(4, 256)
    np.testing.assert_array_equal(tied(ids).numpy().view(np.uint32), want.view(np.uint32))
    tied._kernel = None
    np.testing.assert_array_equal(tied(ids).numpy().view(np.uint32), want.view(np.uint32))
