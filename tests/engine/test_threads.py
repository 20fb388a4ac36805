"""``LLMEngine.step`` on any thread runs the kernels with the engine's thread count (real model)."""

import ctypes
import os
import threading

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.real_model


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenMP's default count is 1 here: nothing to tell apart")
def test_a_fresh_thread_steps_with_the_engines_thread_count():
    """OpenMP keeps its thread count per thread; a new thread starts with the default (every core) until PyTorch
    sets it there. Seen from inside the model runner, the first step on a fresh thread must already use the
    engine's count, and so must a step after the count was changed on its thread."""
    gomp = ctypes.CDLL("libgomp.so.1")  # PyTorch's runtime, already loaded (the kernels share it)
    before = torch.get_num_threads()
    engine = LLMEngine.from_engine_args(num_kv_blocks=16, max_num_seqs=2, num_threads=1)
    try:
        seen = []
        real = engine.model_runner.execute_model

        def execute_model(so):
            seen.append(gomp.omp_get_max_threads())
            return real(so)

        engine.model_runner.execute_model = execute_model
        engine.add_request([1000 + i for i in range(20)], SamplingParams(temperature=0, max_tokens=3), "r")
        fresh = threading.Thread(target=engine.step)
        fresh.start()
        fresh.join()
        assert seen == [1]
        engine.step()
        torch.set_num_threads(2)  # someone else changes the count on this thread: the next step restores the engine's
        engine.step()
        assert seen == [1, 1, 1] and not engine.has_unfinished_requests()
    finally:
        torch.set_num_threads(before)  # the suite's other engines keep their count
