"""The decode-step measurements (``benchmarks.step_profile``, ``benchmarks.roofline``) time
the batch they name: under chunked prefill the first requests decode while later prompts are still computed, and
before the fix they finished inside the measured steps (a "batch 64" profile ran at batch 41)."""

import pytest

from kvserve import LLM
from benchmarks.step_profile import prefill_batch, step_profile

pytestmark = pytest.mark.real_model


def test_the_batch_stays_whole_through_the_measured_steps():
    llm = LLM(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    engine = llm.llm_engine
    prefill_batch(engine, 8, 64, 3, "t")  # 512 prompt tokens: eight steps of 64 tokens, the first ones decoding
    for _ in range(3):
        assert len(engine.scheduler.running) == 8
        outs = engine.step()
        assert sorted(len(o.outputs[0].delta_token_ids) for o in outs) == [1] * 8  # a pure batch-8 decode step
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)


def test_step_profile_rows_add_up_to_the_step():
    prof = step_profile(dict(num_kv_blocks=128, max_num_batched_tokens=64), batches=(1, 4), context=32, repeats=3)
    assert [p["batch"] for p in prof] == [1, 4]
    for p in prof:
        c = p["components"]
        assert all(v >= 0 for k, v in c.items() if k != "engine other") and c["weights"] > 0
        assert abs(sum(c.values()) - p["step_ms"]) < 1e-6 * p["step_ms"] + 1e-9
