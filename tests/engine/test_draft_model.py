"""Speculative decoding with the draft-model proposer on the real model: greedy output identical to no
speculation (batch 1, mixed batches, block edges, near max_tokens, a starved pool), seeded sampling reproducible,
both block pools (the target's and the draft's) clean afterwards, and configuration errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kvserve import LLM, SamplingParams
from kvserve.config import DEFAULT_DRAFT_NUM_LAYERS
from kvserve.model.loader import load_model
from tests.conftest import assert_pool_clean
from tests.engine.spec_common import TEXT, greedy_reference_and_single, prompts

pytestmark = pytest.mark.real_model

# The early exit at 29 of 30 layers agrees with the target on about half the tokens, so drafts are both accepted
# and rejected; the back-off is switched off (break-even acceptance 0) so that every eligible step drafts.
SPEC = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 29}


def make_llm(**kwargs):
    llm = LLM(**{"num_kv_blocks": 128, "block_size": 16, "speculative_config": SPEC, **kwargs})
    llm.llm_engine.speculator.policy.draft_cost = llm.llm_engine.speculator.policy.verify_cost_per_token = 0.0
    return llm


@pytest.fixture(scope="module")
def dm_llm():
    return make_llm()


def assert_both_pools_clean(llm):
    engine = llm.llm_engine
    assert_pool_clean(engine)
    proposer = engine.speculator.proposer
    proposer.check_integrity()
    assert not proposer.seqs
    assert proposer.num_free_blocks == proposer.num_blocks


def test_greedy_identical_batch_one_and_mixed(llm, dm_llm):
    ps = prompts(dm_llm)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = greedy_reference_and_single(llm, dm_llm, ps, sp)
    stats = dm_llm.llm_engine.stats.spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_both_pools_clean(dm_llm)
    # mixed batch: greedy speculating requests next to sampled seeded / unseeded ones (which draft with q) and
    # one with a penalty (which does not speculate)
    mixed_params = [sp, SamplingParams(temperature=0.8, max_tokens=20, seed=3), sp,
                    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12),
                    SamplingParams(temperature=1.0, max_tokens=10, repetition_penalty=1.2), sp]
    mixed = dm_llm.generate(ps + ps[:2], mixed_params)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == reference[i]
    assert mixed[5].outputs[0].token_ids == reference[1]
    assert len(mixed[1].outputs[0].token_ids) == 20 or mixed[1].outputs[0].finish_reason == "stop"
    assert_both_pools_clean(dm_llm)


def test_near_max_tokens_and_block_boundaries(llm, dm_llm):
    # prompts of 15, 16 and 17 tokens put the first drafts on either side of a block edge; max_tokens 1..17 makes
    # drafts shrink near the end, and rollbacks cross block edges
    tok = dm_llm.get_tokenizer()
    base = tok.encode(TEXT)
    for n_prompt in (15, 16, 17):
        for max_tokens in (1, 2, 6, 17):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            ref = llm.generate([base[:n_prompt]], sp)[0].outputs[0].token_ids
            got = dm_llm.generate([base[:n_prompt]], sp)[0].outputs[0]
            assert got.token_ids == ref and len(got.token_ids) == max_tokens
            dm_llm.llm_engine.kv_cache_manager.check_integrity()
            dm_llm.llm_engine.speculator.proposer.check_integrity()
    assert_both_pools_clean(dm_llm)


def test_long_catch_up_split_into_passes(llm, dm_llm):
    """A draft prefill longer than max_catch_up_tokens runs in several passes and drafts the same tokens."""
    ps = prompts(dm_llm)[:2]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    proposer, engine = dm_llm.llm_engine.speculator.proposer, dm_llm.llm_engine

    def run(max_catch_up):
        proposer.max_catch_up_tokens = max_catch_up
        engine.reset_stats()
        passes = proposer.num_forward_passes
        outs = [o.outputs[0].token_ids for o in dm_llm.generate(ps, sp)]
        st = engine.stats.spec_decode
        return outs, (st.num_draft_tokens, st.num_accepted_tokens), proposer.num_forward_passes - passes

    try:
        whole, stats_whole, passes_whole = run(512)
        split, stats_split, passes_split = run(7)
    finally:
        proposer.max_catch_up_tokens = 512
    assert whole == split == [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    assert stats_split == stats_whole and passes_split > passes_whole
    assert_both_pools_clean(dm_llm)


def test_seeded_sampling_reproducible_with_draft_model(dm_llm):
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24, seed=42)
    p = prompts(dm_llm)[0]
    before = dm_llm.llm_engine.stats.spec_decode.num_drafts
    runs = [dm_llm.generate(p, sp)[0].outputs[0].text for _ in range(2)]
    runs.append(dm_llm.generate([p, "Hello"], [sp, SamplingParams(temperature=0, max_tokens=8)])[0].outputs[0].text)
    assert runs[0] == runs[1] == runs[2]
    assert dm_llm.llm_engine.stats.spec_decode.num_drafts > before  # the sampled request did draft
    assert_both_pools_clean(dm_llm)


def test_starved_pool_preemption_and_abort(llm):
    ps = prompts(llm)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    starved = make_llm(num_kv_blocks=9)
    outs = starved.generate(ps, sp)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert starved.llm_engine.stats.num_preemptions > 0
    assert_both_pools_clean(starved)
    # an abort mid-generation releases the draft blocks too
    engine = starved.llm_engine
    rid = engine.add_request(ps[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.speculator.proposer.seqs
    engine.abort_request(rid)
    assert_both_pools_clean(starved)


def test_default_early_exit_backs_off(llm):
    """Default config (early exit at DEFAULT_DRAFT_NUM_LAYERS): output unchanged; a request whose drafts keep
    failing stops drafting for a while, so there are far fewer drafts than decode steps."""
    dm = LLM(num_kv_blocks=64, speculative_config={"method": "draft_model", "num_speculative_tokens": 4})
    assert dm.llm_engine.speculator.proposer.model.arch.num_hidden_layers == DEFAULT_DRAFT_NUM_LAYERS
    assert dm.llm_engine.speculator.proposer.model.layers[0]["qkv"] is dm.llm_engine.model.layers[0]["qkv"]  # shared
    p = dm.apply_chat_template([{"role": "user", "content": "Name three planets."}])
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert dm.generate(p, sp)[0].outputs[0].token_ids == llm.generate(p, sp)[0].outputs[0].token_ids
    stats = dm.llm_engine.stats.spec_decode
    assert 0 < stats.num_drafts < 20
    assert_both_pools_clean(dm)


def write_tiny_model(path, vocab_size, tokenizer, seed=0):
    """A 2-layer random Llama in HF layout (config.json + safetensors + the target's tokenizer files)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "tie_word_embeddings": True, "eos_token_id": 2}
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(vocab_size, 64, generator=g) * 0.02,
         "model.norm.weight": torch.ones(64)}
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
              "mlp.down_proj": (64, 128)}
    for i in range(2):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
        w[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(64)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(64)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "model.safetensors"))
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_separate_draft_model_path(tmp_path, llm):
    tok = load_model().tokenizer
    same = write_tiny_model(tmp_path / "same_vocab", llm.llm_engine.arch.vocab_size, tok)
    dm = LLM(num_kv_blocks=64, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                   "model": same})
    assert dm.llm_engine.speculator.proposer.model.arch.hidden_size == 64
    dm.llm_engine.speculator.policy.draft_cost = dm.llm_engine.speculator.policy.verify_cost_per_token = 0.0
    ps = prompts(llm)[2:]
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, max_tokens=12, seed=7)]
    assert dm.generate(ps, sp)[0].outputs[0].token_ids == llm.generate(ps[0], sp[0])[0].outputs[0].token_ids
    assert dm.llm_engine.stats.spec_decode.num_drafts > 0
    assert_both_pools_clean(dm)
    other = write_tiny_model(tmp_path / "other_vocab", 1000, tok)
    with pytest.raises(ValueError, match=r"different vocabulary.*vocab_size 1000.*vocab_size 49152"):
        LLM(num_kv_blocks=8, speculative_config={"method": "draft_model", "model": other})


@pytest.mark.parametrize("cfg, match", [
    ({"method": "draft_model", "draft_num_layers": 0}, r"draft_num_layers must be an integer >= 1, got 0"),
    ({"method": "draft_model", "draft_num_layers": 30}, r"draft_num_layers must be in \[1, 29\]"),
    ({"method": "draft_model", "draft_num_layers": 2.5}, r"draft_num_layers must be an integer"),
    ({"method": "ngram", "draft_num_layers": 4}, r"draft_num_layers applies to method 'draft_model' only"),
    ({"method": "ngram", "model": "x.gguf"}, r"model applies to method 'draft_model' only"),
    ({"method": "draft_model", "model": "/nonexistent/draft.gguf"}, r"does not exist"),
])
def test_bad_draft_model_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(num_kv_blocks=8, speculative_config=cfg)
