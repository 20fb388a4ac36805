"""``benchmarks.invariance``'s argument checks and its measuring script (the measurements are a benchmark)."""

import pytest

from benchmarks import invariance


def test_the_measuring_script_compiles_and_reports_every_metric():
    compile(invariance.WORKER, "<worker>", "exec")
    assert all(f'res["{m}"]' in invariance.WORKER for m in invariance.METRICS)


@pytest.mark.parametrize("argv, message", [
    (["--baseline", "/nonexistent"], "--baseline must be a kvserve checkout"),
    (["--baseline", ".", "--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        invariance.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
