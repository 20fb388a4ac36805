"""Parity with Hugging Face transformers on the same dequantized weights (the ``"fp32"`` path).

Tolerance for logits: max |ours - transformers| < 1e-3 in float32 (measured ~3e-5: the two differ only in
summation order of the same fp32 ops).
"""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.hf_reference import to_hf_model
from kvserve.model.loader import load_model
from tests.conftest import flat_batch

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Write a short story about a robot who learns to paint. Once upon a time,",
    "List five prime numbers and explain why each is prime. Numbers such as 2, 3 and 5 have exactly two "
    "divisors, which is what makes a number prime. Here is the list with reasons:",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    return to_hf_model(load_model())


def hf_greedy(hf_model, ids):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_match_transformers_batched_and_one_by_one(llm_fp32, hf_model):
    tok = llm_fp32.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # different lengths
    expected = [hf_greedy(hf_model, i) for i in ids]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    batched = [o.outputs[0].token_ids for o in llm_fp32.generate(ids, sp)]
    single = [llm_fp32.generate(i, sp)[0].outputs[0].token_ids for i in ids]
    assert batched == expected
    assert single == expected
    # every sequence runs the full 32 tokens or stops on EOS at the same place in both engines
    assert all(len(e) == NEW_TOKENS or e[-1] in llm_fp32.llm_engine.eos_token_ids for e in expected)
    assert sum(len(e) for e in expected) >= 3 * NEW_TOKENS


def test_logits_close_to_transformers(llm_fp32, hf_model):
    engine = llm_fp32.llm_engine
    model, bs = engine.model, 4
    tok = llm_fp32.get_tokenizer()
    for prompt in PROMPTS:
        ids = torch.tensor(tok.encode(prompt))
        t = len(ids)
        kv = torch.zeros(model.kv_cache_shape(64, bs))
        table = list(range(63, 63 - (t + bs - 1) // bs, -1))  # scattered, descending physical blocks
        ours = model.forward(flat_batch([(ids.tolist(), 0, table)], bs, logits_rows=range(t)), kv)
        with torch.no_grad():
            ref = hf_model(ids[None]).logits[0]
        assert (ours - ref).abs().max().item() < 1e-3
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_prompt_logprobs_match_transformers(llm_fp32, hf_model):
    """``prompt_logprobs`` against transformers' log-softmax, within 1e-4 (chunked prefill, prefix-cache hits and
    preemption: tests/engine/test_prompt_logprobs.py)."""
    ids = llm_fp32.get_tokenizer().encode(PROMPTS[3])
    out = llm_fp32.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for pos, (entry, token) in enumerate(zip(out.prompt_logprobs[1:], ids[1:])):
        assert token in entry and int(ref[pos].argmax()) in entry
        assert max(abs(lp - float(ref[pos, t])) for t, lp in entry.items()) < 1e-4


def test_mixed_prefill_and_decode_batch_matches_separate_runs(llm):
    """A decode token and a prompt in the same flat batch give the same logits as run alone, bit for bit (the
    default path is batch-invariant)."""
    engine = llm.llm_engine
    model, bs = engine.model, 4
    tok = llm.get_tokenizer()
    a, b = tok.encode(PROMPTS[2]), tok.encode(PROMPTS[3])
    kv = torch.zeros(model.kv_cache_shape(64, bs))
    ta = list(range(0, 12))
    tb = list(range(20, 40))

    # step 1: prefill a[:-1] alone
    n = len(a) - 1
    model.forward(flat_batch([(a[:-1], 0, ta)], bs), kv)
    # step 2: a's last token (decode) + all of b (prefill) in one flat batch
    mixed = model.forward(flat_batch([(a[-1:], n, ta), (b, 0, tb)], bs), kv)
    # reference: each alone in a fresh cache
    refs = []
    for seq, table in ((a, ta), (b, tb)):
        kv2 = torch.zeros_like(kv)
        refs.append(model.forward(flat_batch([(seq, 0, table)], bs), kv2)[0])
    assert torch.equal(mixed, torch.stack(refs))


_FALLBACK_SCRIPT = """
import json, sys
from kvserve import LLM, SamplingParams
llm = LLM(num_kv_blocks=64, quantization="fp32")  # cpu_kernels from $KVSERVE_CPU_KERNELS
engine = llm.llm_engine
assert not engine.config.kernel_config.cpu_kernels and not engine.backends.use_kernels
assert engine.model.lm_head.path != "kvserve" and engine.backends.attention.name == "torch-sdpa"
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2])))
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_pytorch_fallback_without_kvserve_kernels_matches_transformers(hf_model, tokenizer):
    """KVSERVE_CPU_KERNELS=0, the default of ``cpu_kernels`` (as on a machine without AVX2 or a C compiler): oneDNN
    matmuls, gather + SDPA attention and PyTorch norms give the same greedy tokens, batched."""
    import json
    import os
    import subprocess
    import sys

    ids = [tokenizer.encode(p) for p in PROMPTS]
    env = {**os.environ, "KVSERVE_CPU_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, json.dumps(ids), str(NEW_TOKENS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [hf_greedy(hf_model, i) for i in ids]
