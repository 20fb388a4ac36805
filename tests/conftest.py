"""Shared fixtures. The real model loads once per test session (``load_model`` caches it in-process)."""

import os

import pytest

# Engines run the default path (the GGUF's quantized weights, kvserve's kernels) unless a test asks for another on
# purpose: parity with transformers passes quantization="fp32" explicitly (llm_fp32, tests/model/test_parity.py).
# The variables that would move every engine (and every subprocess and server a test starts) off it are cleared, so
# a developer's shell cannot change what the suite tests; tests of the variables set them with monkeypatch.
for _name in ("KVSERVE_QUANTIZATION", "KVSERVE_CPU_KERNELS", "KVSERVE_CPU_ISA", "KVSERVE_QUANT_ACTIVATIONS",
              "KVSERVE_FUSED_LAYERS"):
    os.environ.pop(_name, None)

from kvserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


#: Markers (registered in pyproject.toml). ``make test-fast`` deselects all of them: what is left needs no model
#: file, no server, no browser and no Ray, and runs in about a minute.
GROUPS = ("real_model", "server", "browser", "ray", "slow")


#: Fixtures that hold the real model: a test that uses one is marked ``real_model`` at collection.
MODEL_FIXTURES = ("llm", "llm_fp32", "tokenizer")
_current = {"item": None}


def pytest_configure(config):
    """Every load of the default model goes through a check: the test being set up or run must be marked
    ``real_model``, or the load fails at once naming the marker (so the fast lane stays fast)."""
    from kvserve.model import loader

    original = loader.default_model_path

    def guarded():
        item = _current["item"]
        if item is not None and item.get_closest_marker("real_model") is None:
            raise AssertionError(f"{item.nodeid} loads the real model: mark it @pytest.mark.real_model")
        return original()

    loader.default_model_path = guarded


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in MODEL_FIXTURES):
            item.add_marker(pytest.mark.real_model)


def pytest_runtest_setup(item):
    _current["item"] = item  # its fixtures are set up next: module and session ones included


def pytest_runtest_teardown(item):
    _current["item"] = None


@pytest.fixture(scope="session")
def llm():
    """The SmolLM2-135M-Instruct engine on the default path with a roomy pool (512 blocks of 16 tokens)."""
    return LLM(num_kv_blocks=512, max_num_seqs=32)


@pytest.fixture(scope="session")
def llm_fp32():
    """The same engine on the float32 reference path (``quantization="fp32"``): for parity with ``transformers``."""
    return LLM(num_kv_blocks=512, max_num_seqs=32, quantization="fp32")


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


def assert_pool_clean(engine):
    """Every block free, integrity invariants hold, nothing queued."""
    assert not engine.has_unfinished_requests()
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.block_pool.num_free_blocks == engine.num_blocks


def flat_batch(requests, block_size, logits_rows=None):
    """An ``InputBatch`` for raw requests ``[(token_ids, start_pos, block_table), ...]`` through the engine's own
    batch builder; logits of each request's last row, or of the flat rows ``logits_rows`` when given."""
    import torch

    from kvserve.core.sched_output import ScheduledRequest
    from kvserve.batch import build_input_batch

    plan = [ScheduledRequest(str(i), list(ids), start, list(table), samples=True)
            for i, (ids, start, table) in enumerate(requests)]
    batch = build_input_batch(plan, block_size)
    if logits_rows is not None:
        batch.logits_indices = torch.as_tensor(logits_rows, dtype=torch.long)
    return batch


def assert_greedy_matches_transformers(llm, hf, tokenizer, prompts, max_tokens: int = 12):
    """``llm``'s greedy tokens for each prompt (``max_tokens``, EOS ignored) equal ``transformers``' ``generate`` on
    the model ``hf``."""
    import torch

    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, sp)):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist(), prompt


def scattered_block_tables(reqs, block_size: int) -> list:
    """Per ``(tokens in the cache, new query tokens)`` request, a block table of the blocks it needs, taken from a
    shared counter in reverse order (scattered, never contiguous ascending)."""
    tables, next_block = [], 0
    for ctx, q in reqs:
        n = -(-(ctx + q) // block_size)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))
        next_block += n
    return tables
