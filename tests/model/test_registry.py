"""The model registry: a second family (Qwen2, Q/K/V biases) added as one file + one registry line, checked for
parity with ``transformers`` on a tiny randomly initialised model written to a temp dir by ``transformers``."""

import pytest
import torch

from kvserve import LLM
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.qwen2 import Qwen2Model
from kvserve.model.registry import SUPPORTED_ARCHITECTURES, build_model, model_class
from tests.conftest import assert_greedy_matches_transformers, flat_batch

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases (the default init leaves them at 0, which would hide a missing bias)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path, model


def test_registry_lists_both_families():
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                       "MistralForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
                                       "Phi3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM",
                                       "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                                       "MixtralForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM",
                                       "GptOssForCausalLM")
    assert model_class("Qwen2ForCausalLM") is Qwen2Model
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        model_class("GPT2LMHeadModel")


def test_qwen2_logits_and_greedy_tokens_match_transformers(tiny_qwen2, tokenizer):
    path, hf = tiny_qwen2
    loaded = load_model(str(path))
    assert loaded.arch.architecture == "Qwen2ForCausalLM" and loaded.arch.attention_bias
    model = build_model(loaded, select_backends("cpu", torch.float32))
    assert isinstance(model, Qwen2Model) and model.layers[0]["qkv_bias"].shape == (64 + 2 * 32,)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        kv = torch.zeros(model.kv_cache_shape(16, 4))
        table = list(range(15, 15 - (len(ids) + 3) // 4, -1))
        ours = model.forward(flat_batch([(ids, 0, table)], 4, logits_rows=range(len(ids))), kv)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4

    assert_greedy_matches_transformers(LLM(model=str(path), num_kv_blocks=64, quantization="fp32"), hf, tokenizer,
                                       PROMPTS)


def test_qwen2_int8_runs_its_biases_through_the_fused_layer_loop(tiny_qwen2, tokenizer):
    """With int8 weights the layer loop runs in one C call (kvserve/model/fused_layers.py), Q/K/V biases included:
    the same logits, bit for bit, as the Python loop, and within int8 rounding of transformers."""
    from kvserve.model.fused_layers import FusedLayerLoop
    from kvserve.kernels import qgemm as qkernels

    if qkernels.isa() is None:
        pytest.skip(str(qkernels.unavailable_reason()))
    path, hf = tiny_qwen2
    model = build_model(load_model(str(path)), select_backends("cpu", torch.float32, "int8"))
    assert isinstance(model.fused_layers, FusedLayerLoop)
    ids = tokenizer.encode(PROMPTS[1])[:20]  # within the paged-attention kernel's short queries: the fused path
    batch = flat_batch([(ids, 0, [4, 2, 7, 1, 0])], 4, logits_rows=range(len(ids)))
    fused = model.forward(batch, torch.zeros(model.kv_cache_shape(8, 4)))
    loop, model.fused_layers = model.fused_layers, None
    python = model.forward(batch, torch.zeros(model.kv_cache_shape(8, 4)))
    model.fused_layers = loop
    assert torch.equal(fused, python)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (fused - ref).abs().max().item() < 0.05 * ref.abs().max().item()
