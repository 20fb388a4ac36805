"""``AsyncLLM``: the background loop, per-request streams, aborts, shutdown (real model, no HTTP)."""

import asyncio

import pytest

from kvserve import SamplingParams
from kvserve.engine.async_llm import AsyncLLM, EngineShutdownError
from kvserve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


@pytest.fixture()
def engine():
    return LLMEngine.from_engine_args(num_kv_blocks=32, max_num_seqs=8)


def test_streams_match_offline_and_abort_frees_blocks(engine, llm):
    async def run():
        a = AsyncLLM(engine)
        await a.start()
        s1 = await a.add_request("The capital of France is", GREEDY)
        s2 = await a.add_request("Count slowly:", LONG)
        with pytest.raises(ValueError):
            await a.add_request("", GREEDY)  # rejected: nothing queued
        deltas, n2 = [], 0
        async for out in s1:
            deltas.append(out.outputs[0].delta_text)
            final = out
        async for out in s2:
            n2 += 1
            if n2 == 3:
                s2.abort()
        assert s2.finished and a.num_streams == 0
        for _ in range(100):  # the loop applies the abort before its next step
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        await a.shutdown()
        return "".join(deltas), final

    text, final = asyncio.run(run())
    want = llm.generate("The capital of France is", GREEDY)[0].outputs[0]
    assert final.finished and text == final.outputs[0].text == want.text
    assert_pool_clean(engine)


def test_shutdown_aborts_in_flight_and_refuses_new(engine):
    async def run():
        a = AsyncLLM(engine)
        await a.start()
        s = await a.add_request("Count slowly:", LONG)
        await s.__anext__()
        await a.shutdown()
        with pytest.raises(EngineShutdownError):
            async for _ in s:
                pass
        with pytest.raises(EngineShutdownError):
            await a.add_request("Hello", GREEDY)
        assert not a.is_running

    asyncio.run(run())
    assert_pool_clean(engine)


def test_every_engine_call_runs_on_one_thread(engine):
    """Steps and add_request all run on the engine's own thread (a thread pool would hop between threads, each with
    its own cold OpenMP team: the served step then took 2-2.7x longer at 2 threads, docs/performance.md, "One engine thread")."""
    import threading

    threads = []
    real_step, real_add = engine.step, engine.add_request

    def step():
        threads.append(threading.current_thread().name)
        return real_step()

    def add(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_add(*args, **kwargs)

    engine.step, engine.add_request = step, add

    async def run():
        a = AsyncLLM(engine)
        await a.start()
        streams = [await a.add_request(f"Count to {i}:", GREEDY) for i in range(3)]
        for s in streams:
            async for _ in s:
                pass
        await a.shutdown()

    asyncio.run(run())
    assert len(threads) > 6 and set(threads) == {"kvserve-engine_0"}
    assert_pool_clean(engine)
