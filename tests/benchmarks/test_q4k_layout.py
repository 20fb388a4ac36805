"""``benchmarks.q4k_layout``: both Q4_K layouts timed on every path this CPU has, their outputs checked equal."""

import pytest

from benchmarks import q4k_layout
from kvserve.kernels import qgemm

pytestmark = pytest.mark.skipif(qgemm.isa() is None, reason="no quantized-matmul path on this CPU")


def test_both_layouts_timed_and_equal(capsys):
    res = q4k_layout.run(48, 512, [1, 17], copies=2, rounds=1)
    paths = [i for i in qgemm.ISAS if qgemm.cpu_supports(i)]
    assert [(r["isa"], r["rows"]) for r in res] == [(i, m) for i in paths for m in (1, 17)]
    assert all(r["q4k_ms"] > 0 and r["q4f_ms"] > 0 for r in res)
    assert res[0]["q4k_MB"] == 3 * 16 * 296 / 1e6 and res[0]["q4f_MB"] == 3 * 16 * 384 / 1e6
    assert q4k_layout.main(["--shape", "32x256", "--rows", "1", "--rounds", "1", "--copies", "1"]) == 0
    assert "| Q4F / Q4K |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        q4k_layout.main(["--shape", "32x96"])
