"""``benchmarks.kv_disk_tier restart`` at a toy size: the restarted engine loads exactly the prefix's blocks."""

import argparse

import pytest

from benchmarks.kv_disk_tier import restart

pytestmark = pytest.mark.real_model


def test_restart_loads_the_whole_prefix(tmp_path):
    args = argparse.Namespace(prefix_len=64, suffix_len=16, repeats=1, num_kv_blocks=32, max_num_batched_tokens=512,
                              seed=0, dir=str(tmp_path))
    out = restart(args)
    [load] = out["loads"]
    assert load["blocks"] == 4 and load["bytes_read"] == 4 * 368640  # 4 blocks of 16 tokens, bfloat16 K/V (default)
    assert out["bytes_written"] > 4 * 368640 and len(out["cold_ttft_s"]) == 1
