"""``benchmarks.roofline``'s arithmetic (the measurements themselves are a benchmark, not a test)."""

import pytest

from benchmarks.roofline import (Bound, ModelCost, bandwidth_drift, bounds, cpu_info, format_rows,
                                    prefill_bound_tokens_per_s)

COST = ModelCost(weight_bytes=100_000_000, macs_per_token=125_000_000, kv_bytes_per_token=50_000, int8=True)


def test_bounds_exact():
    b = bounds(COST, batch=1, context=0, bandwidth_gbs=20.0, peak_gops=250.0)
    assert b == Bound(bandwidth_ms=5.0, compute_ms=1.0) and b.bound_ms == 5.0
    # 64 rows x 100 tokens x 50 kB of K/V = 320 MB more to read; 64 x 2 x 125 M ops = 16 GOP.
    b = bounds(COST, batch=64, context=100, bandwidth_gbs=20.0, peak_gops=250.0)
    assert b == Bound(bandwidth_ms=21.0, compute_ms=64.0) and b.bound_ms == 64.0
    assert prefill_bound_tokens_per_s(COST, 250.0) == 1000.0


@pytest.mark.parametrize("kw", [dict(batch=0), dict(context=-1), dict(bandwidth_gbs=0.0), dict(peak_gops=-1.0)])
def test_bounds_reject_bad_input(kw):
    args = {**dict(batch=1, context=1, bandwidth_gbs=1.0, peak_gops=1.0), **kw}
    with pytest.raises(ValueError):
        bounds(COST, **args)


def test_table_and_cpu_info():
    table = format_rows([{"batch": 1, "step_ms": 10.0, "bandwidth_ms": 5.0, "compute_ms": 1.0}])
    assert table.splitlines()[-1] == "| 1 | 10.0 | 5.00 | 1.00 | 2.00 | 2.00 | 10.00 |"
    info = cpu_info()
    assert info["cpus"] >= 1 and isinstance(info["model"], str) and isinstance(info["flags"], list)


def test_bandwidth_drift_line():
    """A step at 4.00x its bound at 40 GB/s is 2.00x its bound at 20 GB/s (the bound is bytes / bandwidth)."""
    assert bandwidth_drift(40.0, 20.0, 4.0) == (
        "read bandwidth after the steps 20.0 GB/s (before: 40.0, -50%); batch-1 step / bandwidth bound 4.00x "
        "against the first reading, 2.00x against this one")
    assert bandwidth_drift(40.0, 44.0, None) == "read bandwidth after the steps 44.0 GB/s (before: 40.0, +10%)"
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        bandwidth_drift(0.0, 1.0, None)
