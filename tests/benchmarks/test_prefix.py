"""``benchmarks.prefix`` building blocks on real data: the Mooncake slice's measured hit rate equals the hit rate
computed from its hash ids, and the few-shot prefix is long enough."""

import pytest

from benchmarks.prefix import fewshot_waves, mooncake_waves, run_case
from kvserve.bench.workloads import default_data_dir

DATA = default_data_dir()
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not (DATA / "mooncake").exists(), reason="../shared/data not present"),
]


def test_mooncake_measured_hit_rate_equals_expected():
    waves, expected = mooncake_waves(DATA, num_requests=4, chunk_tokens=32, block_size=16)
    assert 0 < expected < 1
    on = run_case({"num_kv_blocks": 256}, waves, caching=True)
    assert on["hit_rate"] == pytest.approx(expected)
    assert on["prompt_tokens_computed"] == round(on["prompt_tokens"] * (1 - expected))


def test_fewshot_prefix_is_shared_and_long(tokenizer):
    warm, questions = fewshot_waves(tokenizer, DATA, num_questions=3)
    prefix = warm[0].prompt_token_ids
    common = min(len(q.prompt_token_ids) for q in questions)
    shared = next(i for i in range(common) if any(q.prompt_token_ids[i] != prefix[i] for q in questions))
    assert shared >= 1000
