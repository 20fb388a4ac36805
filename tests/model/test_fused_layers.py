"""The whole layer loop in one C call (kvserve/model/fused_layers.py, csrc/decoder.c) on the default quantized model:
the same logits and the same KV cache contents as the Python loop, bit for bit, for the steps it takes; the Python
loop for the steps the attention metadata gives it; a clear error, not a silent fallback, when the kernel fails."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.fused_layers import FusedLayerLoop
from kvserve.kernels import qgemm as qkernels
from tests.conftest import flat_batch, scattered_block_tables

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(qkernels.load() is None or qkernels.isa() is None, reason="quantized kernels unavailable"),
]


@pytest.fixture(scope="module")
def qllm():
    return LLM(num_kv_blocks=256, max_num_seqs=16, quantization="auto")


def _forward_both(model, requests, block_size=16, num_blocks=64, kv_dtype=torch.float32):
    """Run the same batch on two fresh caches of ``kv_dtype``, fused and layer by layer; returns both (logits,
    cache) pairs."""
    batch = flat_batch(requests, block_size)
    fused, out = model.fused_layers, []
    try:
        for f in (fused, None):
            model.fused_layers = f
            cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=kv_dtype)
            out.append((model.forward(batch, cache), cache))
    finally:
        model.fused_layers = fused
    return out


def _assert_bitwise(a, b):
    bits = {4: torch.int32, 2: torch.int16}[a.dtype.itemsize]
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def test_built_for_the_default_quantized_model(qllm, llm_fp32):
    assert isinstance(qllm.llm_engine.model.fused_layers, FusedLayerLoop)
    assert llm_fp32.llm_engine.model.fused_layers is None  # "fp32": float32 Linear projections, the Python loop


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_short_step_equals_the_python_loop_bit_for_bit(qllm, kv_dtype):
    """Over a float32 and a bfloat16 KV cache (``kv_cache_dtype``): the C loop picks the cache type's attention
    kernel, as the Python loop's backend does."""
    model = qllm.llm_engine.model
    # three requests with context in the cache (decode rows and a 5-token span) and a fresh 20-token prompt, all
    # within the paged-attention kernel's short queries
    shape = [(40, 1), (17, 1), (63, 5), (0, 20)]
    tables = scattered_block_tables(shape, 16)
    reqs = [([(7 * i + 3 * j) % 30000 + 100 for j in range(q)], ctx, t) for i, ((ctx, q), t) in
            enumerate(zip(shape, tables))]
    calls, loop = [], model.fused_layers
    model.fused_layers = lambda *a: calls.append(loop(*a)) or calls[-1]  # records what it returned
    try:
        (lf, cf), (lp, cp) = _forward_both(model, reqs, kv_dtype=kv_dtype)
    finally:
        model.fused_layers = loop
    assert len(calls) == 1 and calls[0] is not None  # the fused run took the step (the second had no fused loop)
    _assert_bitwise(lf, lp)
    _assert_bitwise(cf, cp)


def test_a_decode_step_returns_the_final_norm_of_every_row(qllm):
    """A step of one sampled token per request (the forward skips the gather): the normed rows the loop returns are
    the final RMSNorm of the residual stream it leaves, and the logits equal the Python loop's, bit for bit."""
    from kvserve.core.sched_output import ScheduledRequest
    from kvserve.batch import build_input_batch

    model = qllm.llm_engine.model
    plan = [ScheduledRequest(f"r{i}", [100 + i], pos, blocks, samples=True)
            for i, (pos, blocks) in enumerate([(5, [3]), (17, [9, 4]), (0, [7])])]
    results = []
    for fused in (model.fused_layers, None):
        keep, model.fused_layers = model.fused_layers, fused
        try:
            batch = build_input_batch(plan, block_size=16)
            assert batch.logits_rows_are_all()
            cache = torch.zeros(model.kv_cache_shape(16, 16))
            results.append((model.forward(batch, cache), cache))
        finally:
            model.fused_layers = keep
    _assert_bitwise(results[0][0], results[1][0])
    _assert_bitwise(results[0][1], results[1][1])
    batch = build_input_batch(plan, block_size=16)
    with torch.inference_mode():
        h = model.embed(batch.input_ids)
        x = model.fused_layers(h, batch, model.attn.build_metadata(batch), model.ropes(batch),
                               torch.zeros(model.kv_cache_shape(16, 16)))  # h: left the last layer's output
        _assert_bitwise(x, model.ops.rms_norm(h, model.final_norm, model.arch.rms_norm_eps))


def test_a_long_prompt_chunk_runs_in_the_loop_with_the_python_loops_bits(qllm):
    """Every step is in the kernel now: a 300-token chunk beside a decode runs the fused loop, bit for bit the Python
    loop's logits and cache."""
    model = qllm.llm_engine.model
    reqs = [(list(range(200, 500)), 0, list(range(19))), ([5], 20, [40, 41])]
    assert model.attn.build_metadata(flat_batch(reqs, 16)).whole_step_in_kernel
    (lf, cf), (lp, cp) = _forward_both(model, reqs, num_blocks=64)
    _assert_bitwise(lf, lp)
    _assert_bitwise(cf, cp)


def test_a_step_planned_by_another_backend_is_refused(qllm):
    """Metadata from the reference backend (gather + SDPA groups, ``whole_step_in_kernel`` false) is a clear error
    before anything is written."""
    from kvserve.attention.torch_sdpa import TorchSDPABackend

    model = qllm.llm_engine.model
    batch = flat_batch([(list(range(200, 240)), 0, [3, 1, 2]), ([5], 20, [0, 4])], 16)
    meta = TorchSDPABackend().build_metadata(batch)
    h = model.embed(batch.input_ids)
    before = h.clone()
    cache = torch.zeros(model.kv_cache_shape(8, 16))
    with pytest.raises(ValueError, match="does not take this step"):
        model.fused_layers(h, batch, meta, model.ropes(batch), cache)
    assert torch.equal(h, before) and not cache.any()  # nothing done


def test_a_scratch_failure_is_an_error_not_a_fallback(qllm, monkeypatch):
    model = qllm.llm_engine.model
    fused = model.fused_layers

    class FailingLib:
        """Reports a scratch allocation failure."""

        def kvserve_decoder_stack(self, *args):
            return -3

    monkeypatch.setattr(fused, "_lib", FailingLib())
    batch = flat_batch([([11, 12, 13], 0, [2]), ([14], 30, [0, 1])], 16)
    with pytest.raises(MemoryError, match="scratch memory"):
        model.forward(batch, torch.zeros(model.kv_cache_shape(4, 16)))


def test_generation_is_unchanged_and_the_switch_turns_it_off(qllm, monkeypatch):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Name a fruit:"]
    model = qllm.llm_engine.model
    fused = [o.outputs[0].token_ids for o in qllm.generate(prompts, sp)]
    keep, model.fused_layers = model.fused_layers, None
    try:
        python = [o.outputs[0].token_ids for o in qllm.generate(prompts, sp)]
    finally:
        model.fused_layers = keep
    assert fused == python
    off = LLM(num_kv_blocks=32, quantization="auto", fused_layers=False)  # the engine argument turns it off
    assert not off.llm_engine.backends.fused_layers and off.llm_engine.model.fused_layers is None


def test_an_early_exit_draft_gets_its_own_loop_and_a_foreign_cache_is_refused(qllm):
    """The draft model of speculative decoding is a view of the target with its first layers only: it must run its
    own fused loop over its own, shorter cache (found by running the engine tests on the quantized path: the view
    kept the target's loop, which ran 30 layers over a 2-layer cache and crashed)."""
    from kvserve.spec_decode.draft_model import early_exit_model

    target = qllm.llm_engine.model
    draft = early_exit_model(target, 2)
    assert draft.fused_layers is not target.fused_layers and draft.fused_layers._stack.num_layers == 2
    reqs = [([11, 12, 13], 0, [2]), ([14], 30, [0, 1])]
    (fused, _), (python, _) = _forward_both(draft, reqs, num_blocks=4)
    _assert_bitwise(fused, python)
    batch = flat_batch(reqs, 16)
    meta = target.attn.build_metadata(batch)
    h = target.embed(batch.input_ids)
    # the target's loop is handed the draft's 2-layer cache: refused, nothing written
    foreign = torch.zeros(draft.kv_cache_shape(4, 16))
    with pytest.raises(ValueError, match="does not take this step"):
        target.fused_layers(h, batch, meta, target.ropes(batch), foreign)
    assert not foreign.any()


def test_speculative_decoding_with_a_draft_on_the_quantized_path(qllm):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    plain = [o.outputs[0].token_ids for o in qllm.generate(prompts, sp)]
    spec = LLM(num_kv_blocks=256, max_num_seqs=4, quantization="auto",
               speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 4})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    assert got == plain  # greedy: the drafts change the schedule, not the tokens
