"""A fresh clone with no ``../shared`` beside it: the tests that read real data skip, naming the folder, and pass
(issue 41: ``make test`` on a clean clone). Runs the data-dependent test files of a ``git clone`` of this checkout's
HEAD (committed work only) in a subprocess, with the clone's own ``kvserve`` on ``PYTHONPATH``."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: test files that read ../shared/data (``default_data_dir``), but for the two whose other tests load the model for
#: minutes (tests/engine/test_kv_cache_dtype.py, tests/model/test_quantized_model.py: the same guard); the server,
#: browser and Ray tests among them are deselected to keep this run short (they skip by the same guards)
DATA_TESTS = ["tests/bench/test_multiround.py", "tests/benchmarks/test_prefix.py", "tests/entrypoints/test_bench_serve.py",
              "tests/sim/test_sim.py", "tests/structured/test_structured_offline.py"]


@pytest.mark.slow
@pytest.mark.real_model
def test_data_tests_skip_in_a_clone_without_shared(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "main"  # tmp_path/shared does not exist
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(clone)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m",
                        "not server and not browser and not ray", *DATA_TESTS], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    summary = p.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, summary
    reasons = re.findall(r"^SKIPPED \[\d+\] (\S+?):\d+: (.*)$", p.stdout, re.M)
    skipped_files = {f for f, _ in reasons}
    assert all("shared/data" in why or "BFCL" in why for _, why in reasons), reasons
    assert {"tests/bench/test_multiround.py", "tests/benchmarks/test_prefix.py", "tests/sim/test_sim.py",
            "tests/structured/test_structured_offline.py"} <= skipped_files, reasons
