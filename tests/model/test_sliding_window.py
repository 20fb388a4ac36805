"""Sliding-window models end to end (issue 40, item 4): a tiny random Mistral with a window of 8-16 tokens and
prompts of 40-100 tokens (so the window matters), from Hugging Face and from a GGUF, and Qwen2 with
``use_sliding_window`` on its layers from ``max_window_layers``: prompt logprobs within 1e-4 of ``transformers`` and
32 greedy tokens equal on the float32 path (the CPU kernel and the gather + SDPA reference backend); on the default
path, tokens and logprobs bit-equal whether the prompts run alone or together, in one chunk or many."""

import dataclasses
import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import KernelConfig
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from tests.conftest import assert_greedy_matches_transformers, flat_batch
from tests.model.test_families import _tiny, _write_gguf

pytestmark = pytest.mark.real_model  # the real model's tokenizer

PROMPTS = [
    "The capital of France is a city of lights and of long walks along the river, where people meet in small cafes "
    "to talk about art, food and the weather, and where the old bridges carry the evening crowds home after",
    "Once upon a time, in a land far away, there lived a king who had three daughters and a son. The eldest daughter "
    "loved to ride horses through the forest, the second one read every book in the castle library, the youngest "
    "sang songs to the birds in the garden, and the son",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,",
]


def _prompt_logprobs_match(path, hf, tokenizer, loaded=None, cpu_kernels=True):
    """Every prompt's per-position log-softmax (all vocabulary entries) within 1e-4 of ``transformers``'."""
    loaded = loaded or load_model(str(path))
    model = build_model(loaded, select_backends("cpu", torch.float32, "fp32", KernelConfig(cpu_kernels=cpu_kernels)))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert 40 <= len(ids) <= 100, len(ids)
        kv = torch.zeros(model.kv_cache_shape(32, 4))
        table = list(range(31, 31 - (len(ids) + 3) // 4, -1))
        ours = model.forward(flat_batch([(ids, 0, table)], 4, logits_rows=range(len(ids))), kv).log_softmax(-1)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert (ours - ref).abs().max().item() < 1e-4, prompt
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer):
    return _tiny(tmp_path_factory, tokenizer, "mistral_swa", cls="Mistral", sliding_window=8, head_dim=16)


def test_mistral_with_a_window_matches_transformers_on_both_float32_backends(mistral, tokenizer):
    path, hf = mistral
    arch = load_model(str(path), weights_only=True).arch
    assert (arch.sliding_window, arch.layer_types, arch.layer_window(0), arch.layer_window(1)) == (8, None, 8, 8)
    model = _prompt_logprobs_match(path, hf, tokenizer)
    assert model.attn.name == "cpu-kernels" and model.fused_layers is None
    assert _prompt_logprobs_match(path, hf, tokenizer, cpu_kernels=False).attn.name == "torch-sdpa"
    # without the window the same weights give other logits: the window is what matches
    no_window = load_model(str(path), weights_only=True)
    no_window.arch = dataclasses.replace(no_window.arch, sliding_window=None)
    with pytest.raises(AssertionError):
        _prompt_logprobs_match(path, hf, tokenizer, no_window)
    for cpu_kernels in (True, False):
        assert_greedy_matches_transformers(LLM(model=str(path), num_kv_blocks=64, quantization="fp32",
                                               cpu_kernels=cpu_kernels), hf, tokenizer, PROMPTS, max_tokens=32)


def test_mistral_with_a_window_from_gguf_matches_transformers(mistral, tokenizer, tmp_path):
    path, hf = mistral
    gguf_path = _write_gguf(tmp_path / "m.gguf", hf, "llama", True,
                            extra_fields=[("llama.attention.sliding_window", 8)])
    loaded = load_model(str(gguf_path), weights_only=True)
    assert loaded.arch.sliding_window == 8
    _prompt_logprobs_match(gguf_path, hf, tokenizer, loaded)


def test_the_default_path_gives_the_same_bits_alone_together_and_chunked(mistral):
    """The quantized default path with the window: each prompt alone, all three together, and in 16-token chunks
    give the same tokens and the same logprobs, bit for bit (the kernel's batch invariance with a window)."""
    path, _ = mistral
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    runs = []
    for kw in (dict(), dict(max_num_batched_tokens=16, block_size=4)):
        llm = LLM(model=str(path), num_kv_blocks=256, **kw)
        together = llm.generate(PROMPTS, sp)
        alone = [llm.generate([p], sp)[0] for p in PROMPTS]
        for a, b in zip(together, alone):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
        runs.append(together)
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_qwen2_use_sliding_window_windows_the_layers_from_max_window_layers(tmp_path_factory, tokenizer):
    path, hf = _tiny(tmp_path_factory, tokenizer, "qwen2_swa", cls="Qwen2", bias=True, rope_theta=10000.0,
                     use_sliding_window=True, sliding_window=12, max_window_layers=1)
    arch = load_model(str(path), weights_only=True).arch
    assert arch.layer_types == ("full_attention", "sliding_attention")
    assert (arch.layer_window(0), arch.layer_window(1)) == (None, 12)
    _prompt_logprobs_match(path, hf, tokenizer)
    _prompt_logprobs_match(path, hf, tokenizer, cpu_kernels=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(max_window_layers=2, layer_types=None)  # no layer windowed: the plain model (and its fused loop)
    (path / "config.json").write_text(json.dumps(cfg))
    arch = load_model(str(path), weights_only=True).arch
    assert (arch.sliding_window, arch.layer_types) == (None, None)


@pytest.mark.parametrize("edit, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), r"unsupported layer_types="),
    (dict(sliding_window=0), r"sliding_window must be a positive"),
], ids=["mistral-layer-types", "zero-window"])
def test_window_fields_kvserve_cannot_follow_are_refused(mistral, tmp_path, edit, message):
    path, _ = mistral
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), weights_only=True)


def test_a_qwen2_gguf_with_a_window_is_refused(tmp_path_factory, tokenizer, tmp_path):
    """A GGUF does not say which of a Qwen2's layers its window covers (``max_window_layers``): refused."""
    _, hf = _tiny(tmp_path_factory, tokenizer, "qwen2_plain", cls="Qwen2", rope_theta=10000.0)
    path = _write_gguf(tmp_path / "q.gguf", hf, "qwen2", False, extra_fields=[("qwen2.attention.sliding_window", 12)])
    with pytest.raises(ValueError, match=r"qwen2.attention.sliding_window=12"):
        load_model(str(path), weights_only=True)


def test_blocks_behind_the_window_go_back_and_every_engine_feature_gives_the_same_tokens(mistral):
    """The engine frees the blocks a windowed Mistral has left behind (window 8, blocks of 4: a decoding request
    holds at most 3 blocks however long it runs), and greedy tokens are the same with prefix caching on and off,
    after prefix-cache hits, after a preemption and with speculative decoding (n-gram drafts, rolled back when
    rejected; the random model accepts none)."""
    path, _ = mistral
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(model=str(path), num_kv_blocks=256, block_size=4, enable_prefix_caching=False, quantization="fp32")
    engine = base.llm_engine
    assert engine.kv_cache_manager.sliding_window == 8
    ids = [engine.add_request(p, sp) for p in PROMPTS]
    finals, step = {}, 0
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step())
        step += 1
        if step == 5:  # all three decoding: 3 blocks each (without the window: 12-22 each)
            assert engine.kv_cache_manager.block_pool.num_used_blocks == 9
            engine.scheduler._preempt(engine.scheduler.running[1])  # recomputed from its prompt and outputs
    assert engine.stats.num_preemptions == 1
    reference = [o.outputs[0].token_ids for o in base.generate(PROMPTS, sp)]
    assert [finals[i].outputs[0].token_ids for i in ids] == reference
    for kw in (dict(enable_prefix_caching=True),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 2})):  # drafts the random model rejects: rollbacks
        llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, quantization="fp32", **kw)
        for _ in range(2):  # the second round hits the prefix cache where it is on
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == reference, kw
        e = llm.llm_engine
        assert not e.has_unfinished_requests() and e.kv_cache_manager.block_pool.num_free_blocks == e.num_blocks
        e.kv_cache_manager.check_integrity()
        if "enable_prefix_caching" in kw:
            assert e.kv_cache_manager.prefix_cache_hits > 0
        else:
            assert e.speculator.stats.num_draft_tokens > 0  # (accepted drafts: tests/core/test_sliding_window_blocks.py)
