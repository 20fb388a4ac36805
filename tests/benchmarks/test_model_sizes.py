"""``benchmarks.model_sizes``: its random-weight GGUFs (a tiny Llama shape through the same writer) hold the tensors
and metadata stated, load in kvserve and generate; llama.cpp reads them too where ``llama_cpp`` is installed."""

import argparse
import subprocess

import gguf
import numpy as np
import pytest

from benchmarks.model_sizes import (FORMATS, LLAMA_PYTHON, SHAPES, Shape, format_table, llama3_rope_factors,
                                    llama_measure, more_bits, parse_args, tensor_types, write_gguf)
from kvserve import LLM, SamplingParams

TINY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512)
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("model_sizes")
    return {f: write_gguf(d / f"tiny-{f}.gguf", TINY, f, seed=0) for f in FORMATS if f != "mxfp4"}  # (MoE only)


def test_q4_k_m_layers_as_llama_quantize():
    # llama-quantize's choice: the first and last eighth, and every third layer between.
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(28) if more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    types = tensor_types(SHAPES["1b"], "q4_k_m")
    six = sorted(n for n, t in types.items() if t == Q.Q6_K)
    assert len(six) == 1 + 2 * 8 and "token_embd.weight" in six and "blk.4.attn_v.weight" in six
    assert types["blk.2.ffn_down.weight"] == Q.Q4_K and types["blk.2.ffn_gate.weight"] == Q.Q4_K
    with pytest.raises(ValueError, match="format must be one of"):
        tensor_types(TINY, "q5_k_m")


def test_rope_factors_equal_transformers_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = SHAPES["1b"]
    rope = {"rope_type": "llama3", "factor": s.rope_factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_context,
            "rope_theta": s.rope_theta}
    cfg = LlamaConfig(hidden_size=s.hidden, num_attention_heads=s.heads, rope_theta=s.rope_theta,
                      rope_scaling=rope, max_position_embeddings=s.context)
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2) / s.head_dim)
    np.testing.assert_allclose(base / inv.double().numpy(), llama3_rope_factors(s), rtol=1e-5)


@pytest.mark.real_model  # its tokenizer is copied into every file
def test_files_hold_the_stated_tensors(files):
    for fmt, path in files.items():
        r = gguf.GGUFReader(str(path))
        got = {t.name: t.tensor_type for t in r.tensors}
        want = tensor_types(TINY, fmt)
        assert {n: got[n] for n in want} == want
        assert got["rope_freqs.weight"] == Q.F32 and "output.weight" not in got  # tied, as Llama 3.2
        assert r.fields["general.architecture"].contents() == "llama"
        assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152
        emb = next(t for t in r.tensors if t.name == "token_embd.weight")
        assert list(emb.shape) == [256, 49152]
        w = gguf.quants.dequantize(emb.data[:64], emb.tensor_type)
        assert np.isfinite(w).all() and 0.001 < np.abs(w).mean() < 0.1
    # Q4_K_M on 2 layers: layer 1 (the last eighth) gets Q6_K attn_v / ffn_down, layer 0 stays Q4_K
    t = tensor_types(TINY, "q4_k_m")
    assert (t["blk.1.attn_v.weight"], t["blk.1.ffn_down.weight"], t["blk.0.attn_v.weight"]) == (Q.Q6_K, Q.Q6_K, Q.Q4_K)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k_m", "q8_0", "q2_k", "q3_k"])
def test_kvserve_loads_and_generates(files, fmt, llm):
    eng = LLM(model=str(files[fmt]), max_model_len=256, num_kv_blocks=32, enable_prefix_caching=False)
    arch = eng.llm_engine.model.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.vocab_size, arch.num_key_value_heads) == (2, 256, 49152, 2)
    assert arch.tie_word_embeddings and arch.rope_theta == 500000.0
    np.testing.assert_allclose(arch.rope_scaling.freq_factors, llama3_rope_factors(TINY), rtol=1e-6)
    text = "Hello, my name is"
    assert eng.get_tokenizer().encode(text) == llm.get_tokenizer().encode(text)  # SmolLM2's tokenizer
    out = eng.generate([text], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 49152 for t in out.token_ids)
    if fmt in ("q2_k", "q3_k"):  # kept in their own bits (Q2K, Q6 layouts), never widened to float32
        assert eng.llm_engine.model.layers[0]["down"].path.startswith(fmt + "/")


def _has_llama_cpp() -> bool:
    try:
        return subprocess.run([LLAMA_PYTHON, "-c", "import llama_cpp"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.real_model
@pytest.mark.skipif(not _has_llama_cpp(), reason=f"no llama_cpp under {LLAMA_PYTHON}")
def test_llama_cpp_reads_the_files(files):
    args = argparse.Namespace(llama_python=LLAMA_PYTHON, seed=0, measure=["decode", "prefill"], rounds=1,
                              prompt_tokens=8, decode_tokens=4, prefill_tokens=16)
    for fmt in ("q4_0", "q4_k_m"):
        res = llama_measure(files[fmt], args, 1)
        assert "error" not in res, res
        assert res["decode_tps"] > 0 and res["prefill_tps"] > 0


def test_command_line_and_table():
    a = parse_args(["--sizes", "1b", "--formats", "q4_0,q8_0", "--concurrency", "16"])
    assert (a.sizes, a.formats, a.concurrency, a.prompt_tokens, a.decode_tokens) == (["1b"], ["q4_0", "q8_0"], [16],
                                                                                     128, 128)
    with pytest.raises(SystemExit):
        parse_args(["--formats", "q5_k"])
    row = {"file": "1b-q4_0", "mb": 700.0, "bandwidth_bound_ms": 20.0, "wall_s": 61.0,
           "kvserve": {"decode_tps": 40.0, "step_ms": 25.0, "prefill_tps": 300.0, "throughput": {16: 200.0}},
           "llama.cpp": {"decode_tps": 32.0, "step_ms": 31.25, "prefill_tps": 150.0}}
    assert format_table([row], [16]).splitlines()[-1] == (
        "| 1b-q4_0 | 700 | 20.0 | 40.0 / 32.0 | 1.25x | 1.56x | 1.25x | 300 / 150 | 2.00x | 200.0 | 61 |")
    a = parse_args(["--prefill-activations", "int8", "--cpu-isa", "avx2"])
    assert (a.prefill_activations, a.cpu_isa) == (["int8"], "avx2")
    with pytest.raises(SystemExit):
        parse_args(["--prefill-activations", "int4"])
    row["kvserve"]["prefill_tps_int8"] = 450.0
    table = format_table([row], [16], ("int8",)).splitlines()
    assert "prefill kvserve int8 / llama.cpp" in table[0]
    assert table[-1] == ("| 1b-q4_0 | 700 | 20.0 | 40.0 / 32.0 | 1.25x | 1.56x | 1.25x | 300 / 150 | 2.00x | 450 | 3.00x "
                         "| 200.0 | 61 |")


@pytest.mark.real_model
@pytest.mark.parametrize("arch, qk_norm", [("olmoe", "proj"), ("qwen3moe", "head")])
def test_a_mixture_of_experts_file_loads_and_generates(tmp_path, arch, qk_norm, llm):
    """The MoE shapes' writer (a tiny one): stacked Q4_K / Q6_K experts, a float32 router, the expert keys; kvserve
    reads it as the family's MoE and generates; the roofline counts the top-k experts a token reads."""
    from benchmarks.roofline import model_cost

    tiny = Shape(layers=2, hidden=256, heads=4, kv_heads=2, ffn=256, rope_theta=10000.0, context=512, arch=arch,
                 head_width=64, experts=8, experts_used=2, qk_norm=qk_norm)
    path = write_gguf(tmp_path / "moe.gguf", tiny, "q4_k_m", seed=0)
    r = gguf.GGUFReader(str(path))
    got = {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in r.tensors}
    assert got["blk.0.ffn_gate_exps.weight"] == (Q.Q4_K, [256, 256, 8])
    assert got["blk.1.ffn_down_exps.weight"][0] == Q.Q6_K and got["blk.0.ffn_gate_inp.weight"][0] == Q.F32
    assert r.fields[f"{arch}.expert_count"].contents() == 8
    eng = LLM(model=str(path), max_model_len=256, num_kv_blocks=32, enable_prefix_caching=False)
    model = eng.llm_engine.model
    assert model.arch.moe.num_experts == 8 and model.spec.layers[0].mlp == "moe"
    out = eng.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8

    def nbytes(lin):
        parts = getattr(lin, "parts", [lin])
        return sum(p.weight_bytes() if hasattr(p, "weight_bytes") else p.numel() * 4 for p in parts)

    read = nbytes(model.lm_head) + sum(nbytes(w["qkv"]) + nbytes(w["o"]) + nbytes(w["moe"].router) + 2 * (
        nbytes(w["moe"].experts[0].gate_up) + nbytes(w["moe"].experts[0].down)) for w in model.layers)
    assert model_cost(model).weight_bytes == read  # 2 of the 8 experts per layer


@pytest.mark.real_model
def test_a_gpt_oss_file_loads_and_generates(tmp_path, llm):
    """The gpt-oss shape's writer (a tiny one): MXFP4 experts with biases, Q8_0 attention with biases and sinks, the
    window and YaRN keys; kvserve reads it as gpt-oss (sinks, the window on every other layer, MXFP4 experts on the
    MX4 kernel) and generates."""
    from kvserve.quant.pack import FMT_MX4

    tiny = Shape(layers=2, hidden=256, heads=4, kv_heads=2, ffn=256, rope_theta=150000.0, rope_factor=8.0,
                 original_context=64, context=512, arch="gpt-oss", head_width=64, experts=8, experts_used=2,
                 window=16)
    path = write_gguf(tmp_path / "gpt-oss.gguf", tiny, "mxfp4", seed=0)
    r = gguf.GGUFReader(str(path))
    got = {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in r.tensors}
    assert got["blk.0.ffn_up_exps.weight"] == (Q.MXFP4, [256, 256, 8])
    assert got["blk.1.attn_q.weight"][0] == Q.Q8_0 and got["blk.0.attn_sinks.weight"] == (Q.F32, [4])
    eng = LLM(model=str(path), max_model_len=256, num_kv_blocks=32, enable_prefix_caching=False)
    model = eng.llm_engine.model
    assert model.arch.layer_types == ("sliding_attention", "full_attention") and model.spec.attention_sinks
    assert model.layers[0]["moe"].experts[0].down.packed.fmt == FMT_MX4
    out = eng.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
