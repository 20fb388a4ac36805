"""GGUF K-quants on their own kernels in the real model: SmolLM2-135M with its ``ffn_down`` weights (1536 wide: the
only ones whose rows are whole 256-value super-blocks) re-quantized to a K-quant (``benchmarks.requantize_gguf``),
run on the file's own kernels with 15-bit activations (``quant_activations="int8x2"``) over a float32 KV cache
(so what is left is the weights' error: a bfloat16 cache, and on AMX its bfloat16 queries, moved a near-tie digit of
the second prompt), against the ``"fp32"`` path of the same file (the same dequantized weights): greedy tokens equal,
teacher-forced top-1 agreement >= 99% on the first GSM8K rows (1,000 positions). The default 8-bit activations'
rounding is measured in docs/quantization.md and bounded in tests/model/test_quantized_model.py."""

import pytest

from benchmarks.accuracy import compare_all, gsm8k_texts
from benchmarks.requantize_gguf import requantize
from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import default_data_dir
from kvserve.kernels import qgemm as quant_kernels
from kvserve.model import loader

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(quant_kernels.isa() is None, reason=str(quant_kernels.unavailable_reason()))]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module", params=["Q6_K", "Q5_K"])
def kfile(request, tmp_path_factory):
    """(type name, path of the re-quantized file)."""
    path = tmp_path_factory.mktemp("kquant") / f"smollm2-{request.param}.gguf"
    types = requantize(loader.default_model_path(), path, request.param, only=["ffn_down"])
    assert sum(t == request.param for t in types.values()) == 30
    return request.param, path


def test_k_quant_file_runs_on_its_kernel_with_fp32_greedy_tokens(kfile):
    qtype, path = kfile
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    quant = LLM(model=str(path), num_kv_blocks=64, max_num_seqs=4, quant_activations="int8x2",
                kv_cache_dtype="float32")
    down = quant.llm_engine.model.layers[0]["down"].path
    assert down.startswith(f"{qtype.lower()}/{quant_kernels.isa()}"), down  # not q8_from_*: the file's values
    ref = LLM(model=str(path), num_kv_blocks=64, max_num_seqs=4, quantization="fp32")
    got = [o.outputs[0].token_ids for o in quant.generate(PROMPTS, sp)]
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)]
    assert got == want  # measured: 64 of 64 tokens agree on each of 4 prompts (docs/quantization.md)
    if (default_data_dir() / "gsm8k" / "test.jsonl").exists():
        texts = gsm8k_texts(ref.get_tokenizer(), 1000)
        r = compare_all(ref.llm_engine.model, {"auto": quant.llm_engine.model}, texts)["auto"]
        assert r.top1_agreement >= 0.99 and abs(r.ppl_change) <= 0.01
