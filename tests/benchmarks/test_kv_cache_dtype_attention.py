"""``python -m benchmarks.kv_cache_dtype --measure attention``: a row per (cache type, build this CPU runs), with the
AMX build's paired ratio to the AVX-512 build's where this CPU has it, for a decode batch and for one prompt."""

import pytest

from benchmarks.kv_cache_dtype import measure_attention, parse_args
from kvserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


@pytest.mark.parametrize("extra", [["--requests", "4"], ["--attention-prompt", "40"]])
def test_a_row_per_cache_type_and_build(extra):
    rows = measure_attention(parse_args(["--measure", "attention", "--rounds", "10", *extra]))
    builds = cpu_kernels.attention_isas()
    assert [(r["kv"], r["isa"]) for r in rows] == [(k, i) for k in ("f32", "bf16", "i8") for i in builds]
    for r in rows:
        p10, p30, p50 = r["new_ms_p10_p30_p50"]
        assert 0 < p10 <= p30 <= p50
        assert ("amx_over_avx512" in r) == (r["isa"] == "amx") and r.get("amx_over_avx512", 1) > 0
