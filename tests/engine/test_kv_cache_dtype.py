"""``kv_cache_dtype`` on the real model: a bfloat16 pool holds twice the blocks of a float32 one in the same memory,
every pool (the engine's, a draft model's) takes the type, the model's predictions over it stay the float32
cache's to within rounding, copy-on-write and preemption work on it without leaking a block, and bad values are
refused with the field's name. The kernels' bit-level behaviour is tested in tests/attention/test_kv_cache_dtype.py."""

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from benchmarks.accuracy import compare_all, gsm8k_texts
from benchmarks.roofline import model_cost
from kvserve.bench.workloads import default_data_dir
from kvserve.sim.cli import build_simulator
from kvserve.sim.cost_model import FEATURES, CostModel
from kvserve.sim.profile import PROFILE_FORMAT
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(kv_cache_dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8)


def test_the_pool_is_bfloat16_and_holds_twice_the_blocks(bf16_llm):
    engine = bf16_llm.llm_engine
    assert engine.kv_cache_dtype == BF16 and engine.model_runner.kv_cache.dtype == BF16
    model = engine.model
    # SmolLM2-135M: 30 layers x K and V x 16 tokens x 3 KV heads x 64 dims
    assert model.bytes_per_block(16, BF16) == 30 * 2 * 16 * 3 * 64 * 2 == model.bytes_per_block(16) // 2
    assert model_cost(model, BF16).kv_bytes_per_token == 30 * 2 * 3 * 64 * 2  # the roofline's KV bytes too
    budget = 10 * model.bytes_per_block(16)
    f32 = LLM(kv_cache_memory_bytes=budget, kv_cache_dtype="float32").llm_engine
    bf16 = LLM(kv_cache_memory_bytes=budget).llm_engine  # "auto": the weights are quantized
    assert (f32.num_blocks, bf16.num_blocks) == (10, 20)
    assert f32.model_runner.kv_cache.dtype == torch.float32 and bf16.model_runner.kv_cache.dtype == BF16


def test_auto_is_bfloat16_for_quantized_weights_and_the_models_dtype_for_float_ones(tmp_path, llm):
    """``kv_cache_dtype="auto"``: the default GGUF's projections run on the int8 kernels, so its pool is bfloat16;
    the float32 path (``quantization="fp32"``) and a float model keep float32 (exact), and a float model quantized
    at load (``quantization="int8"``) gets bfloat16, as the engine's log line and the limits say."""
    from tests.engine.test_draft_model import write_tiny_model

    assert llm.llm_engine.kv_cache_dtype == BF16 and llm.llm_engine.limits.kv_cache_dtype == "bfloat16"
    assert LLM(quantization="fp32", num_kv_blocks=8).llm_engine.model_runner.kv_cache.dtype == torch.float32
    tiny = write_tiny_model(tmp_path / "tiny", llm.llm_engine.arch.vocab_size, llm.get_tokenizer())
    assert LLM(model=tiny, num_kv_blocks=8).llm_engine.model_runner.kv_cache.dtype == torch.float32
    assert LLM(model=tiny, num_kv_blocks=8, quantization="int8").llm_engine.model_runner.kv_cache.dtype == BF16


def test_predictions_over_a_bf16_cache_match_the_float32_cache(bf16_llm):
    """Teacher-forced over the first GSM8K texts (>= 2,000 positions): the same model's argmax over a bfloat16 cache
    equals its argmax over a float32 cache at >= 96% of positions, perplexity within 0.5%. On the default int8
    activations a cache's rounding can move an activation across an int8 rounding step, so either cache type moves
    about 2.5% of the argmaxes (Sapphire Rapids, 2,221 positions: 97.2% equal and -0.06% perplexity with the AMX
    attention build's bfloat16 queries, 97.5% and -0.18% with the AVX-512 build's float32 ones; on the first 779
    positions alone a few near-ties swung the perplexity by +0.16% and +0.52%)."""
    data = default_data_dir()
    if not (data / "gsm8k" / "test.jsonl").exists():
        pytest.skip("needs ../shared/data")
    model = bf16_llm.llm_engine.model
    texts = gsm8k_texts(bf16_llm.get_tokenizer(), 2000, data)
    r = compare_all(model, {"bf16": model}, texts, kv_cache_dtypes={"bf16": BF16})["bf16"]
    assert r.positions >= 2000
    assert r.top1_agreement >= 0.96 and abs(r.ppl_change) <= 0.005


def test_copy_on_write_and_preemption_on_a_bf16_pool_free_every_block():
    """Parallel sampling (n=3 forks a shared prompt block: copy-on-write) and a pool too small for every request
    at once (preemption by recompute), over a bfloat16 pool: every request finishes with its token count and the
    pool is whole again; greedy tokens are the same as the request alone on the same pool type."""
    llm = LLM(kv_cache_dtype="bfloat16", num_kv_blocks=12, block_size=16, max_num_seqs=6)
    prompts = [f"Tell me about the number {i}." for i in range(5)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts[0], greedy)[0].outputs[0].token_ids
    outs = llm.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.llm_engine.stats.num_preemptions > 0  # the pool did run dry
    assert outs[0].outputs[0].token_ids[:8] == alone[:8]
    fork = llm.generate("Once upon a time", SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5,
                                                        ignore_eos=True))[0]
    assert [len(c.token_ids) for c in fork.outputs] == [20, 20, 20]
    assert_pool_clean(llm.llm_engine)


def test_a_draft_models_pool_takes_the_type():
    llm = LLM(kv_cache_dtype="bfloat16", num_kv_blocks=64,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 4})
    assert llm.llm_engine.speculator.proposer.kv_cache.dtype == BF16
    out = llm.generate("Count: one two three one two three", SamplingParams(max_tokens=12, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("bad", ["fp8", "float16", "", None, 16])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype=bad, num_kv_blocks=8)


def test_the_simulator_refuses_a_profile_of_another_cache_type(tmp_path):
    """A profile's step costs were measured over one cache type; replaying them for another would be wrong."""
    prof = {"format": PROFILE_FORMAT, "model": "m.gguf", "dtype": "float32", "kv_cache_dtype": "float32",
            "kv_bytes_per_token": 100, "max_position_embeddings": 64,
            "cost_model": CostModel(0.01, dict.fromkeys(FEATURES, 0.0)).to_dict()}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match=r"'kv_cache_dtype' is 'float32' \(the KV cache it was measured over\), "
                                         "the run asks for kv_cache_dtype 'bfloat16'"):
        build_simulator({"model": "m.gguf", "kv_cache_dtype": "bfloat16", "num_kv_blocks": 8}, path)
    sim, _ = build_simulator({"model": "m.gguf", "kv_cache_dtype": "auto", "num_kv_blocks": 8}, path)
    assert sim is not None


# ---- int8 (kv_cache_dtype="int8": values and a bfloat16 scale per token and KV head, kvserve.attention.kv_layout)

@pytest.fixture(scope="module")
def int8_llm():
    return LLM(kv_cache_dtype="int8", num_kv_blocks=64, max_num_seqs=8)


def test_an_int8_pool_holds_1_9x_the_tokens_of_bfloat16_in_the_same_bytes(int8_llm):
    engine = int8_llm.llm_engine
    assert engine.kv_cache_dtype == torch.int8
    cache = engine.model_runner.kv_cache
    assert cache.dtype == torch.int8 and cache.shape == (30, 2, 64, 16, 3, 66)  # 64 values + a 2-byte scale
    model = engine.model
    assert model.bytes_per_block(16, torch.int8) == 30 * 2 * 16 * 3 * 66 == 190_080
    assert model_cost(model, torch.int8).kv_bytes_per_token == 30 * 2 * 3 * 66
    budget = 100 * model.bytes_per_block(16, BF16)
    bf16 = LLM(kv_cache_memory_bytes=budget, kv_cache_dtype="bfloat16").llm_engine
    int8 = LLM(kv_cache_memory_bytes=budget, kv_cache_dtype="int8").llm_engine
    assert (bf16.num_blocks, int8.num_blocks) == (100, 193)  # 1.93x: 128 bytes a head row against 66
    assert int8.num_blocks >= 1.9 * bf16.num_blocks


def test_predictions_over_an_int8_cache_match_the_float32_cache(int8_llm):
    """Teacher-forced over the first GSM8K texts (>= 600 positions): argmax equal to the float32 cache's at >= 96%
    of positions (on the default int8 activations; see the bfloat16 test), perplexity within 1%
    (docs/kv_cache_dtype.md has the full measurement)."""
    data = default_data_dir()
    if not (data / "gsm8k" / "test.jsonl").exists():
        pytest.skip("needs ../shared/data")
    model = int8_llm.llm_engine.model
    texts = gsm8k_texts(int8_llm.get_tokenizer(), 600, data)
    r = compare_all(model, {"int8": model}, texts, kv_cache_dtypes={"int8": torch.int8})["int8"]
    assert r.positions >= 600
    assert r.top1_agreement >= 0.96 and abs(r.ppl_change) <= 0.01


def test_copy_on_write_preemption_and_a_draft_pool_on_int8():
    llm = LLM(kv_cache_dtype="int8", num_kv_blocks=12, block_size=16, max_num_seqs=6)
    prompts = [f"Tell me about the number {i}." for i in range(5)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts[0], greedy)[0].outputs[0].token_ids
    outs = llm.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.llm_engine.stats.num_preemptions > 0
    assert outs[0].outputs[0].token_ids == alone  # batch invariance: the same tokens beside others, re-prefilled
    fork = llm.generate("Once upon a time", SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5,
                                                        ignore_eos=True))[0]
    assert [len(c.token_ids) for c in fork.outputs] == [20, 20, 20]
    assert_pool_clean(llm.llm_engine)
    spec = LLM(kv_cache_dtype="int8", num_kv_blocks=64,
               speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 4})
    assert spec.llm_engine.speculator.proposer.kv_cache.dtype == torch.int8
    plain = LLM(kv_cache_dtype="int8", num_kv_blocks=64)
    sp = SamplingParams(max_tokens=12, temperature=0)
    text = "Count: one two three one two three"
    assert spec.generate(text, sp)[0].outputs[0].token_ids == plain.generate(text, sp)[0].outputs[0].token_ids


def test_an_unknown_kv_cache_dtype_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'float32', 'bfloat16', 'int8'\), "
                                         r"got 'int4'"):
        LLM(kv_cache_dtype="int4", num_kv_blocks=8)
