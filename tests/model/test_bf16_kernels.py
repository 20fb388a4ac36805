"""``quant_activations="bf16"``: the AMX-BF16 matmul (kvserve/kernels/csrc/qgemm_amx_bf16.h) on the real tiles.

What is checked, on a CPU with AMX-BF16 (skipped elsewhere, with the reason):
- every format with a bfloat16 decoder equals the float64 product of the bfloat16-rounded operands to float32
  rounding (a weight may round to its neighbouring bfloat16, 2^-8 of that product: the bound below);
- a row's bits do not depend on the other rows, the row count (a lone decode row runs in a padded 16-row tile), the
  tile shape (1 x 4 groups for up to 16 rows, 2 x 2 beyond), the chunking, nor the output groups' split;
- a format without a decoder (Q6_K, Q3_K, Q2_K, MXFP4) runs its int8 tiles: the ``"int8"`` bits;
- the engine: ``LLM(quant_activations="bf16")`` on the default model, the same greedy tokens alone and batched,
  and a clear error where the CPU lacks it.
"""

import numpy as np
import pytest
import torch

from kvserve.kernels import qgemm as kernels
from kvserve.layers.quant_linear import QuantLinear
from kvserve.quant import formats
from kvserve.quant import pack as P
from tests.model.test_quant_kernels import _gguf_tensor, _random_packed

HAS_BF16 = kernels.load() is not None and kernels.cpu_supports("amx_int8") and \
    kernels.activations_supported("amx_int8", "bf16")
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="CPU lacks AMX-BF16 (or the OS did not grant the tiles)")

ROWS = (1, 3, 15, 16, 17, 31, 33, 64, 129)  # one row, tails, the 1x4 and 2x2 shapes, odd tile pairs
BF16_KINDS = ["q4", "q4f", "q8", "int8", "q5f", "q4k"]  # _random_packed kinds with a bfloat16 decoder
INT8_KINDS = ["q6", "mx4", "q2k", "q3k"]


@needs_bf16
@pytest.mark.parametrize("kind", BF16_KINDS)
@pytest.mark.parametrize("n,k", [(72, 256), (48, 1536), (40, 96)])
def test_bf16_formats_equal_the_rounded_reference(kind, n, k):
    rng = np.random.default_rng(n + k)
    if kind in ("q4k",) and k % 256:
        k = 256
    packed, w = _random_packed(kind, n, k, rng)
    assert packed.fmt in kernels.BF16_FORMATS
    for rows in ROWS:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[0, :3] = (40.0, -40.0, 0.0)
        got = kernels.qgemm(torch.from_numpy(x), packed, "amx_int8", "bf16").numpy().astype(np.float64)
        os = np.ones(n) if packed.oscale is None else packed.oscale.numpy().astype(np.float64)[:n]
        w_dec = w / os[:, None]  # per-channel int8: the output scale is applied after the sums
        ref = kernels.reference_qgemm(x, w_dec, "bf16") * os
        mag = (np.abs(kernels.round_bf16(x)) @ np.abs(kernels.round_bf16(w_dec)).T) * os + 1e-30
        err = np.abs(got - ref) / mag
        assert err.max() <= 2.0 ** -8, (rows, err.max())  # a neighbouring bfloat16 at most, for a few weights
        assert np.median(err) <= 1e-6, (rows, np.median(err))  # the rest: float32 sums


@needs_bf16
@pytest.mark.parametrize("kind", BF16_KINDS + INT8_KINDS)
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(kind):
    rng = np.random.default_rng(3)
    k = 512 if kind in ("q6", "q4k", "q2k", "q3k") else 288
    packed, _ = _random_packed(kind, 88, k, rng)  # 5.5 groups: the threads' shares and the 1x4 sets differ
    x = torch.from_numpy(rng.standard_normal((129, k)).astype(np.float32))
    whole = kernels.qgemm(x, packed, "amx_int8", "bf16")
    for m in ROWS:
        assert torch.equal(kernels.qgemm(x[:m], packed, "amx_int8", "bf16"), whole[:m]), m
    for i in (0, 7, 16, 40, 100, 128):
        assert torch.equal(kernels.qgemm(x[i:i + 1], packed, "amx_int8", "bf16"), whole[i:i + 1]), i
        assert torch.equal(kernels.qgemm(x[max(0, i - 20):i + 1], packed, "amx_int8", "bf16")[-1:], whole[i:i + 1])
    if kind in INT8_KINDS:  # no bfloat16 decoder: the int8 tiles, for every M
        assert torch.equal(whole, kernels.qgemm(x, packed, "amx_int8", "int8"))


@needs_bf16
@pytest.mark.parametrize("kind", BF16_KINDS)
def test_rows_whose_activations_outgrow_l2_give_the_same_bits(kind):
    """Past 1 MiB of bfloat16 activations (``BF16_DECODED_BYTES``) a thread decodes up to 1 MiB of groups at once and
    runs each pair of row tiles over all of them: every row's bits are still its own, alone or in a few rows."""
    rng = np.random.default_rng(5)
    k = 2048  # 300 rows: 1.2 MiB of activations; 64 KiB a decoded group, so sets of 16 groups
    packed, _ = _random_packed(kind, 16 * 21 + 8, k, rng)  # 21.5 groups: a full set, a part set and a half group
    x = torch.from_numpy(rng.standard_normal((300, k)).astype(np.float32))
    whole = kernels.qgemm(x, packed, "amx_int8", "bf16")
    assert torch.equal(kernels.qgemm(x[:40], packed, "amx_int8", "bf16"), whole[:40])
    for i in (0, 17, 150, 299):
        assert torch.equal(kernels.qgemm(x[i:i + 1], packed, "amx_int8", "bf16"), whole[i:i + 1]), i


@needs_bf16
@pytest.mark.parametrize("qtype", [formats.Q4_0, formats.Q4_1, formats.Q8_0, formats.Q4_K, formats.Q5_K])
def test_gguf_layers_report_the_bf16_path(qtype):
    from kvserve.layers.quant_linear import make_linear_method

    k = 512 if qtype in (formats.Q4_K, formats.Q5_K) else 96
    layer = make_linear_method(_gguf_tensor(qtype, 40, k, seed=2), path=kernels.QuantPath("amx_int8", "bf16"))
    assert layer.path.endswith("/amx_int8+bf16")
    q6 = make_linear_method(_gguf_tensor(formats.Q6_K, 40, 256, seed=2), path=kernels.QuantPath("amx_int8", "bf16"))
    assert q6.path == "q6_k/amx_int8"  # runs int8: no suffix


def test_bf16_where_the_cpu_lacks_it_is_a_value_error(monkeypatch):
    """A path without AMX-BF16 (``avx2`` always lacks it) refuses ``"bf16"``, naming the field, in the engine's
    path choice and in a layer built by hand; the kernel itself refuses ``act=2`` on another path (-1)."""
    if kernels.load() is None or not kernels.cpu_supports("avx2"):
        pytest.skip("no kernel library or no AVX2")
    with pytest.raises(ValueError, match=r"quant_activations='bf16' needs the amx_int8 path on a CPU with AMX-BF16"):
        kernels.choose_path(True, "avx2", "bf16")
    x, y = torch.randn(2, 32), torch.empty(2, 16)
    w = P.pack_q4(np.zeros((16, 32), np.uint8), np.ones((16, 1), np.float16), np.zeros((16, 1), np.float16))
    with pytest.raises(ValueError, match=r"activations='bf16' needs the amx_int8 path on a CPU with AMX-BF16"):
        QuantLinear(w, "q4", isa="avx2", activations="bf16")
    assert kernels.load().kvserve_qgemm(w.fmt, kernels.ISAS["avx2"], kernels.ACTIVATIONS["bf16"], x.data_ptr(), 2,
                                        32, w.data.data_ptr(), 16, None, y.data_ptr(), 16) == -1


@needs_bf16
@pytest.mark.real_model
def test_engine_bf16_greedy_tokens_alone_and_batched():
    """The default model with ``quant_activations="bf16"``: each prompt's 24 greedy tokens are the same alone and in
    a batch of three with chunked prefill (a 16-token budget), and the layers report the path."""
    from kvserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(quant_activations="bf16", max_num_seqs=4, num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.model.layers[0]["qkv"].path == "q4/amx_int8+bf16"
    assert "linear q4/amx_int8+bf16 (LM head q8/amx_int8+bf16)" in engine.backends.describe(engine.model.layers[0]["qkv"], engine.model.lm_head)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert batched == alone
    chunked = LLM(quant_activations="bf16", max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, sp)] == alone
    int8 = LLM(max_num_seqs=4, num_kv_blocks=64)
    ids8 = [o.outputs[0].token_ids for o in int8.generate(prompts, sp)]
    assert sum(a[:4] == b[:4] for a, b in zip(alone, ids8)) >= 2  # the same model: the first tokens mostly agree


@needs_bf16
def test_a_failed_bf16_self_check_withdraws_bf16_only(monkeypatch):
    """``"bf16"`` is checked on its own: if its check failed, ``quant_activations="bf16"`` would be refused while
    the ``amx_int8`` path (chosen by the integer activations' check) stays."""
    assert kernels._bf16_checked("amx_int8")  # the real check passes on this CPU
    kernels._bf16_checked.cache_clear()
    monkeypatch.setattr(kernels, "self_check", lambda name, activations=("int8", "int8x2"): "bf16" not in activations)
    try:
        assert not kernels.activations_supported("amx_int8", "bf16")
        with pytest.raises(ValueError, match="quant_activations='bf16' needs the amx_int8 path"):
            kernels.choose_path(True, "auto", "bf16")
        assert kernels.choose_path(True, "auto", "int8") == kernels.QuantPath("amx_int8", "int8")
    finally:
        kernels._bf16_checked.cache_clear()
