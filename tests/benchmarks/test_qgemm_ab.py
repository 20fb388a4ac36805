"""``benchmarks.qgemm_ab``: a commit's matmul library built from git and timed against this checkout's, paired, the
outputs compared (HEAD against the checkout: the same bits unless the kernels changed since)."""

import subprocess
from pathlib import Path

import pytest

from benchmarks import qgemm_ab
from kvserve.kernels import qgemm

pytestmark = pytest.mark.skipif(qgemm.load() is None or not qgemm.cpu_supports("avx2"), reason="no AVX2 kernels")


def _kernels_changed_since_head() -> bool:
    r = subprocess.run(["git", "status", "--porcelain", qgemm_ab.CSRC], capture_output=True, text=True)
    return r.returncode != 0 or bool(r.stdout.strip())


def test_head_against_this_checkout_paired_and_compared(capsys, tmp_path):
    if _kernels_changed_since_head():
        pytest.skip("the kernels' sources differ from HEAD in this checkout (or no git): the bits may differ")
    assert qgemm_ab.main(["--baseline", "HEAD", "--kinds", "q8,q4", "--shapes", "o", "--rows", "1,17",
                          "--isa", "avx2", "--activations", "int8", "--rounds", "2"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| q")]
    assert [(r[0], r[2]) for r in rows] == [("| q8", "1"), ("| q8", "17"), ("| q4", "1"), ("| q4", "17")]
    assert all(r[-1] == "True |" for r in rows)  # the same bits
    with pytest.raises(SystemExit):
        qgemm_ab.main(["--baseline", "HEAD", "--shapes", "lm_head"])
    with pytest.raises(subprocess.CalledProcessError):
        qgemm_ab.build_baseline("no-such-revision", tmp_path)
