"""The same request gives the same answer however it is served, on the default path (the GGUF's 4-bit weights, int8
activations, kvserve's attention kernel): bit-identical token ids and logprobs alone, beside 31 other requests,
with chunk budgets of 16 / 64 / 512 tokens, after prefix-cache hits of 1, 2 and all full blocks, after a preemption,
with the prefix cache's disk tier cold, warm, after a restart and after eviction from a small pool (and with a
flipped, truncated or foreign entry, which is recomputed), and streamed or not over HTTP (and over an int8 KV cache:
alone, beside others, in chunks, after prefix-cache hits and a preemption); seeded samples with n > 1 as when alone;
speculative decoding at temperature 0 as
without it. Also the exact greedy ids of this model per instruction-set path (the AVX2 and AVX-512 builds round
differently; each is the same on every machine that runs it, on any thread count)."""

import json
import os

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.block_pool import hash_block
from kvserve.core.kv_disk_store import ENTRY_HEADER, DiskBlockStore
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import qgemm
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

QUESTION = ("You are a careful assistant. Answer in two sentences, plainly, without lists. "
            "Explain why the sky looks blue during the day and red at sunset, and what the sun's light has to do "
            "with it. Mention the atmosphere, the colour of the ocean on a clear afternoon, and why clouds look "
            "white or grey depending on how thick they are.")
OTHERS = ["Write a haiku about the sea.", "List three prime numbers: 2, 3,", "Name a fruit.",
          "Why do cats purr? Give one reason.", "Count: one two three", "What is 12 times 12?"]
MAX_TOKENS = 24


def _greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True, **kw)


def _answer(out):
    """What must not change: the token ids and, per token, the top logprobs (floats compared exactly)."""
    c = out.outputs[0]
    return c.token_ids, [sorted(d.items()) for d in c.logprobs]


@pytest.fixture(scope="module")
def prompt():
    llm = LLM(num_kv_blocks=64)
    text = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    ids = llm.get_tokenizer().encode(text)
    assert 6 * 16 < len(ids) < 7 * 16  # six full blocks of 16 and a partial one
    return ids


@pytest.fixture(scope="module")
def base():
    """The default engine, prefix caching off; and the request's answer alone."""
    return LLM(num_kv_blocks=512, max_num_seqs=32, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(base, prompt):
    out = base.generate([prompt], _greedy())[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    return _answer(out)


def _others(n):
    return [OTHERS[i % len(OTHERS)] + " " * (i // len(OTHERS)) for i in range(n)]


def test_beside_31_other_requests(base, prompt, alone):
    ps = _others(15) + [prompt] + _others(16)
    outs = base.generate(ps, [SamplingParams(temperature=0.0, max_tokens=8 + i % 20) for i in range(15)] + [_greedy()]
                         + [SamplingParams(temperature=0.0, max_tokens=3 + i) for i in range(16)])
    assert _answer(outs[15]) == alone
    assert_pool_clean(base.llm_engine)


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_any_chunk_budget(prompt, alone, budget):
    llm = LLM(num_kv_blocks=64, max_num_batched_tokens=budget, enable_prefix_caching=False)
    outs = llm.generate([prompt, _others(1)[0]], [_greedy(), SamplingParams(temperature=0.0, max_tokens=30)])
    assert _answer(outs[0]) == alone


def test_after_prefix_cache_hits_of_1_2_and_all_full_blocks(prompt, alone):
    llm = LLM(num_kv_blocks=96, enable_prefix_caching=True)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    for blocks in (1, 2, 6):
        kv.block_pool.reset_prefix_cache()
        warm = prompt[: 16 * blocks] + [t + 1 for t in prompt[16 * blocks: 16 * blocks + 20]]  # differs after
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2))
        hits = kv.prefix_cache_hits
        assert _answer(llm.generate([prompt], _greedy())[0]) == alone, blocks
        assert kv.prefix_cache_hits - hits == 16 * blocks
    assert _answer(llm.generate([prompt], _greedy())[0]) == alone  # the whole prompt again: every full block


def test_after_a_preemption(prompt, alone):
    llm = LLM(num_kv_blocks=14, max_num_seqs=4, enable_prefix_caching=False)  # 224 slots for 4 x ~130 tokens
    outs = llm.generate([prompt] + _others(3), [_greedy()] + [SamplingParams(temperature=0.0, max_tokens=60,
                                                                             ignore_eos=True)] * 3)
    assert llm.llm_engine.stats.num_preemptions > 0
    assert _answer(outs[0]) == alone
    assert_pool_clean(llm.llm_engine)


def _prompt_block_hashes(prompt, n):
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block(parent, prompt[16 * i : 16 * (i + 1)])
        hashes.append(parent)
    return hashes


def test_disk_tier_cold_warm_after_a_restart_and_after_eviction(prompt, alone, tmp_path):
    llm = LLM(num_kv_blocks=64, kv_disk_cache_dir=str(tmp_path))  # cold: computed, its full blocks written
    tier, kv = llm.llm_engine.kv_tier, llm.llm_engine.kv_cache_manager
    assert _answer(llm.generate([prompt], _greedy())[0]) == alone
    tier.flush()
    assert tier.stats.blocks_written == (len(prompt) + MAX_TOKENS - 1) // 16
    assert (tier.stats.lookups, tier.stats.hits) == (6, 0)  # six full blocks looked up on disk, none there
    assert _answer(llm.generate([prompt], _greedy())[0]) == alone  # warm: the pool's own hits
    assert kv.prefix_cache_hits == 6 * 16 and (tier.stats.lookups, tier.stats.hits) == (6, 0)
    llm.llm_engine.shutdown()

    again = LLM(num_kv_blocks=64, kv_disk_cache_dir=str(tmp_path))  # a restart: the six blocks come from disk
    tier, kv = again.llm_engine.kv_tier, again.llm_engine.kv_cache_manager
    assert _answer(again.generate([prompt], _greedy())[0]) == alone
    assert (tier.stats.lookups, tier.stats.hits, tier.stats.bad_entries) == (6, 6, 0)
    assert tier.stats.bytes_read == 6 * again.llm_engine.model_runner.block_nbytes
    assert kv.prefix_cache_hits == 6 * 16

    small = LLM(num_kv_blocks=14, kv_disk_cache_dir=str(tmp_path))  # 224 slots: another prompt evicts ours
    tier, kv = small.llm_engine.kv_tier, small.llm_engine.kv_cache_manager
    assert _answer(small.generate([prompt], _greedy())[0]) == alone
    evictor = [t + 7 for t in prompt] + prompt[:80]
    small.generate([evictor], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    pool_hits = sum(kv.block_pool.lookup(h) is not None for h in _prompt_block_hashes(prompt, 6))
    assert kv.block_pool.num_evictions > 0 and pool_hits < 6
    hits = tier.stats.hits
    assert _answer(small.generate([prompt], _greedy())[0]) == alone
    assert tier.stats.hits - hits >= 6 - pool_hits  # what the pool lost came back from disk
    assert_pool_clean(small.llm_engine)


def test_disk_tier_bad_entries_are_recomputed(prompt, alone, tmp_path):
    LLM(num_kv_blocks=64, kv_disk_cache_dir=str(tmp_path)).generate([prompt], _greedy())
    third = _prompt_block_hashes(prompt, 3)[2]
    for damage in ("flipped byte", "truncated", "another fingerprint"):
        llm = LLM(num_kv_blocks=64, kv_disk_cache_dir=str(tmp_path))
        tier = llm.llm_engine.kv_tier
        path = tier.store.path(third.value)
        good = path.read_bytes()
        if damage == "flipped byte":
            path.write_bytes(good[:-1000] + bytes([good[-1000] ^ 1]) + good[-999:])
        elif damage == "truncated":
            path.write_bytes(good[: len(good) // 3])
        else:  # another model's entry for the same tokens (other K/V bits), whole and checksummed
            payload = good[ENTRY_HEADER.size + 8 * 16 :]
            other = DiskBlockStore(tmp_path, bytes(32), 10**12)
            other.put(third, [bytes(b ^ 0x40 for b in payload[:4096]) + payload[4096:]])
            os.replace(other.path(third.value), path)
        assert _answer(llm.generate([prompt], _greedy())[0]) == alone, damage
        assert (tier.stats.hits, tier.stats.bad_entries) == (2, 1), damage  # blocks 0, 1 loaded; 2.. recomputed
        tier.flush()
        assert path.read_bytes() == good, damage  # written again when recomputed
        llm.llm_engine.shutdown()


def test_seeded_samples_with_n_4_as_when_alone(base, prompt):
    sp = SamplingParams(n=4, temperature=0.8, seed=1234, max_tokens=16, logprobs=1)
    one = base.generate([prompt], sp)[0]
    mixed = base.generate(_others(7) + [prompt] + _others(8), [SamplingParams(temperature=0.7, max_tokens=12)] * 7
                          + [sp] + [SamplingParams(temperature=0.0, max_tokens=5)] * 8)[7]
    got = [(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in mixed.outputs]
    assert got == [(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in one.outputs]
    assert len({tuple(c.token_ids) for c in one.outputs}) > 1  # the samples differ from each other


def _same_beside_others_in_chunks_on_one_thread_after_hits_and_a_preemption(prompt, **engine_kw):
    """The prompt's answer on engines built with ``engine_kw``: alone, then beside 15 others, in 16-token chunks on
    one thread, after every full block is a prefix-cache hit, and after a preemption: the same every time."""
    sp = _greedy()
    ref = LLM(num_kv_blocks=512, max_num_seqs=32, enable_prefix_caching=False, **engine_kw)
    alone = _answer(ref.generate([prompt], sp)[0])
    outs = ref.generate(_others(7) + [prompt] + _others(8), [SamplingParams(temperature=0.0, max_tokens=9)] * 7
                        + [sp] + [SamplingParams(temperature=0.0, max_tokens=4 + i) for i in range(8)])
    assert _answer(outs[7]) == alone
    chunked = LLM(num_kv_blocks=96, max_num_batched_tokens=16, num_threads=1, **engine_kw)
    assert _answer(chunked.generate([prompt], sp)[0]) == alone  # 16-token chunks, one thread
    hits = chunked.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits
    assert _answer(chunked.generate([prompt], sp)[0]) == alone  # every full block a prefix-cache hit
    assert chunked.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits - hits == 16 * 6
    small = LLM(num_kv_blocks=14, max_num_seqs=4, enable_prefix_caching=False, **engine_kw)
    outs = small.generate([prompt] + _others(3), [sp] + [SamplingParams(temperature=0.0, max_tokens=60,
                                                                        ignore_eos=True)] * 3)
    assert small.llm_engine.stats.num_preemptions > 0
    assert _answer(outs[0]) == alone
    assert_pool_clean(small.llm_engine)


def test_over_an_int8_kv_cache_beside_others_in_chunks_after_hits_and_a_preemption(prompt):
    """``kv_cache_dtype="int8"``: each token's K/V rows are quantized once, when written, with a scale of their own,
    so the stored bytes and every row's attention are the same however the request is scheduled."""
    _same_beside_others_in_chunks_on_one_thread_after_hits_and_a_preemption(prompt, kv_cache_dtype="int8")


@pytest.mark.skipif(not (qgemm.load() is not None and qgemm.cpu_supports("amx_int8")
                         and qgemm.activations_supported("amx_int8", "bf16")),
                    reason="CPU lacks AMX-BF16 (quant_activations='bf16')")
def test_bf16_activations_beside_others_in_chunks_on_one_thread_after_hits_and_a_preemption(prompt):
    """``quant_activations="bf16"``: every row of a matmul runs on the AMX-BF16 tiles, a lone decode row included,
    so a row's bits are the same however many rows the step holds."""
    _same_beside_others_in_chunks_on_one_thread_after_hits_and_a_preemption(prompt, quant_activations="bf16")


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 29},
], ids=["ngram", "draft_model"])
def test_speculative_decoding_gives_the_same_tokens(base, prompt, spec):
    text = "The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown"
    ps = [prompt, text]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in base.generate(ps, sp)]
    llm = LLM(num_kv_blocks=128, speculative_config=spec, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == reference
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0  # verification rows made tokens


def test_streamed_and_not_over_http(prompt, alone):
    from tests.entrypoints.conftest import LiveServer

    server = LiveServer(num_kv_blocks=64, enable_prefix_caching=False).start()
    try:
        body = {"model": server.llm_model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 2, "ignore_eos": True}
        plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        streamed, text = [], ""
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    if choice.get("logprobs"):
                        lp = choice["logprobs"]
                        streamed += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        lp = plain["logprobs"]
        assert streamed == list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        assert text == plain["text"]
        ids, logprobs = alone  # and the offline engine's answer alone, to the bit
        assert lp["token_logprobs"] == [dict(top)[t] for t, top in zip(ids, logprobs)]
    finally:
        server.stop()


#: The greedy ids of QUESTION on the default path, per attention build (the quantized matmul's path with its
#: default activations: AMX-INT8 gives the AVX-512 VNNI path's bits; the AMX attention build rounds the queries to
#: bfloat16 for its score tiles), the same on 1 and 2 threads. Made with this test's engine, alone.
EXPECTED = {
    # "The sky looks blue during the day because of the way the Earth reflects sunlight, which is a result of the
    # scattering of" (over the bfloat16 cache "auto" gives quantized weights; the float32 cache gave "... day and red
    # at sunset because of the way ...")
    "avx2": [504, 6376, 5117, 4461, 981, 260, 1194, 975, 282, 260, 970, 260, 2591, 9404, 8118, 28, 527, 314, 253, 966,
             282, 260, 24484, 282],
    # "The sky looks blue during the day and red at sunset because the Earth's atmosphere reflects sunlight, allowing
    # us to see the" (int8 activations, the default since issue 47; AMX gives the same ids)
    "avx512": [504, 6376, 5117, 4461, 981, 260, 1194, 284, 2382, 418, 21822, 975, 260, 2591, 506, 5264, 9404, 8118, 28,
               3910, 468, 288, 963, 260],
    # "The sky looks blue during the day because of the way the Earth reflects sunlight, which is composed of a
    # mixture of different" (cpu_isa "amx_int8" or "auto" on an AMX-BF16 CPU)
    "amx": [504, 6376, 5117, 4461, 981, 260, 1194, 975, 282, 260, 970, 260, 2591, 9404, 8118, 28, 527, 314, 8168, 282,
            253, 8196, 282, 896],
}


@pytest.mark.parametrize("cpu_isa", ["avx2", "avx512_vnni", "amx_int8"])
def test_the_exact_greedy_ids_of_each_instruction_set_path(prompt, cpu_isa):
    if not qgemm.cpu_supports(cpu_isa):
        pytest.skip(f"this CPU has no {cpu_isa}")
    llm = LLM(num_kv_blocks=64, cpu_isa=cpu_isa)
    key = cpu_kernels.attention_isa(cpu_isa)
    assert llm.llm_engine.model.attn.isa == key
    engine, layer = llm.llm_engine, llm.llm_engine.model.layers[0]["qkv"]
    describe = engine.backends.describe  # the start-up log line: the code that runs over each cache type
    assert f"attention cpu-kernels/{key}," in describe(layer, engine.model.lm_head, engine.kv_cache_dtype)
    assert f"attention cpu-kernels/{'avx512' if key == 'amx' else key}," in describe(layer, engine.model.lm_head,
                                                                                   torch.int8)
    ids = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert ids.outputs[0].token_ids == EXPECTED[key]


# ------------------------------------------------------------------------------------------------ mixture of experts


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_path(request, tmp_path_factory, tokenizer):
    """A tiny random Qwen3-MoE (8 experts, 2 per token, every layer sparse), or gpt-oss (the same, with attention
    sinks and a 6-token window on layer 0), as a Hugging Face directory: the default path runs its projections and
    experts on the quantized kernels."""
    if request.param == "gpt_oss":
        from tests.model.test_families_gpt_oss import _tiny_gpt_oss

        return _tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), tokenizer)[0]
    from tests.model.test_families_moe import _tiny_moe

    return _tiny_moe(tmp_path_factory, tokenizer, "qwen3_moe")[0]


def test_moe_bits_alone_batched_with_other_experts_chunked_and_after_a_prefix_hit(moe_path, prompt):
    """A MoE model's request gives the same token ids and logprobs, bit for bit, alone, beside 7 other requests whose
    tokens choose other experts (checked: a step's rows choose different expert pairs), in
    16-token chunks, and after prefix-cache hits of 2 and all full blocks."""
    base = LLM(model=str(moe_path), num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=False)
    alone = _answer(base.generate([prompt], _greedy())[0])
    model = base.llm_engine.model
    moe = model.layers[0]["moe"]
    chosen, route = [], moe.route

    def recording(x):
        w, ids = route(x)
        chosen.append(ids)
        return w, ids

    moe.route = recording
    outs = base.generate(_others(3) + [prompt] + _others(4), [SamplingParams(temperature=0.0, max_tokens=6 + i)
                                                              for i in range(3)] + [_greedy()]
                         + [SamplingParams(temperature=0.0, max_tokens=4 + i) for i in range(4)])
    moe.route = route
    steps = [ids for ids in chosen if ids.shape[0] > 1]  # a decode step's rows: one per request
    assert sum(len({tuple(sorted(r)) for r in ids.tolist()}) > 1 for ids in steps) > len(steps) // 2
    assert _answer(outs[3]) == alone
    chunked = LLM(model=str(moe_path), num_kv_blocks=256, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _answer(chunked.generate([prompt, _others(1)[0]], [_greedy(), SamplingParams(temperature=0.0)])[0]) == alone
    cached = LLM(model=str(moe_path), num_kv_blocks=256, enable_prefix_caching=True)
    kv = cached.llm_engine.scheduler.kv_cache_manager
    warm = prompt[:32] + [t + 1 for t in prompt[32:52]]
    cached.generate([warm], SamplingParams(temperature=0.0, max_tokens=2))
    hits = kv.prefix_cache_hits
    assert _answer(cached.generate([prompt], _greedy())[0]) == alone
    assert kv.prefix_cache_hits - hits == 32
    assert _answer(cached.generate([prompt], _greedy())[0]) == alone  # every full block
