"""``kvserve serve --step-trace``: one line per engine step of ``AsyncLLM``'s loop, with the plan of that step (real
model), read back by ``kvserve.sim.trace.read_step_trace`` and turned into cost-model features."""

import argparse
import asyncio

import pytest

from kvserve import SamplingParams
from kvserve.engine import step_trace
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints import ray_serve_args
from kvserve.sim.cost_model import row_features, step_features
from kvserve.sim.trace import read_step_trace


def test_each_step_is_one_line_with_its_plan(tmp_path):
    engine = LLMEngine.from_engine_args(num_kv_blocks=32, max_num_seqs=4)
    prompt = list(range(1000, 1021))  # 21 tokens: one prefill step, then one decode step per further token
    plans = []
    real_step = engine.step

    def step():
        outs = real_step()
        plans.append(step_features(engine.last_scheduler_output))
        return outs

    engine.step = step

    async def run():
        a = AsyncLLM(engine)
        a.step_trace = step_trace.StepTrace(tmp_path / "steps.jsonl")  # 64 lines buffered between writes
        await a.start()
        s = await a.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        async for _ in s:
            pass
        for _ in range(100):  # the loop idles after the last step and writes what it buffered then
            if len(read_step_trace(tmp_path / "steps.jsonl")) == 4:
                break
            await asyncio.sleep(0.02)
        before_shutdown = read_step_trace(tmp_path / "steps.jsonl")
        await a.shutdown()
        return before_shutdown

    assert len(asyncio.run(run())) == 4
    steps = read_step_trace(tmp_path / "steps.jsonl")
    assert [rows for _, _, _, rows in steps] == [[(21, 0, 0, 1)], [(1, 21, 0, 1)], [(1, 22, 0, 1)], [(1, 23, 0, 1)]]
    assert [more for _, _, more, _ in steps] == [True, True, True, False]  # the last step finished the request
    assert all(t0 < t1 for t0, t1, _, _ in steps) and all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))
    assert [row_features(rows) for _, _, _, rows in steps] == plans  # the trace keeps what the features need


def test_read_names_the_bad_line(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_text('{"t0": 1.0, "t1": 1.5, "more": 1, "rows": [[4, 0, 0, 1]]}\n{"t0": 2.0}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_step_trace(p)


def test_unwritable_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--step-trace: cannot write"):
        step_trace.StepTrace(tmp_path / "no" / "such" / "dir" / "steps.jsonl")


def test_step_trace_refuses_replicas():
    args = argparse.Namespace(data_parallel_size=2, ray_address=None, step_trace="steps.jsonl")
    with pytest.raises(ValueError, match="--step-trace records one engine"):
        ray_serve_args.wants_ray(args)
    args.data_parallel_size = 1
    assert ray_serve_args.wants_ray(args) is False
