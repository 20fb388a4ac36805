"""``benchmarks.window_attention``: its argument checks and its table at a tiny size (timings are a benchmark, not
a test: only the table's shape is checked)."""

import pytest

from benchmarks.window_attention import main
from kvserve.kernels import cpu as cpu_kernels


@pytest.mark.parametrize("argv, message", [(["--context", "0"], "--context must be >= 1"),
                                           (["--windows", "8", "-1"], "--windows must be >= 0"),
                                           (["--repeats", "0"], "--repeats must be >= 1")])
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        main(argv)


@pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))
def test_the_table_has_a_row_per_window_and_a_column_per_build():
    lines = main(["--context", "100", "--windows", "0", "16", "--requests", "2", "--heads", "4", "2", "16",
                  "--repeats", "1"])
    builds = len(cpu_kernels.attention_isas())
    assert len(lines) == 4 and lines[2].startswith("| none | ") and lines[3].startswith("| 16 | ")
    assert all(len(line.split("|")) == builds + 4 for line in lines)
