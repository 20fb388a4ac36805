"""``kvserve.entrypoints.memory_report``: the smaps parser, the breakdown of this process (KV pool pages counted exactly), the
stage probe, ``kvserve generate --report-memory`` on the real model, and the CLI's lazy imports. No memory
thresholds of the machine are asserted: only that the breakdown is computed and adds up."""

import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

from kvserve.entrypoints.memory_report import MemoryProbe, format_memory, memory_report, parse_smaps, rss_breakdown
from kvserve.worker.kv_pool import lazy_zeros

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
PAGE = os.sysconf("SC_PAGE_SIZE")

SMAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                 120 kB
Anonymous:           120 kB
7f0000000000-7f0000400000 r--s 00000000 08:01 1234                       /home/u/.cache/kvserve/weights/ab-auto-cd.kvpack
Size:               4096 kB
Rss:                2048 kB
Anonymous:             0 kB
7f1000000000-7f1000010000 r-xp 00000000 08:01 99                         /venv/lib/libtorch_cpu.so
Rss:                  40 kB
Anonymous:             8 kB
7f1000010000-7f1000011000 rw-p 00010000 08:01 99                         /venv/lib/libtorch_cpu.so
Rss:                   4 kB
Anonymous:             4 kB
7f2000000000-7f2000001000 r--p 00000000 08:01 7                          /usr/share/locale/x.mo
Rss:                   4 kB
Anonymous:             0 kB
7f3000000000-7f3000100000 rw-p 00000000 00:00 0 
Rss:                  16 kB
Anonymous:            16 kB
"""


def test_parse_smaps_exact():
    maps = parse_smaps(SMAPS)
    assert [(m.start, m.end, m.rss // 1024, m.anonymous // 1024, m.kind) for m in maps] == [
        (0x55D0C0000000, 0x55D0C0021000, 120, 120, "heap and anonymous"),
        (0x7F0000000000, 0x7F0000400000, 2048, 0, "weights"),
        (0x7F1000000000, 0x7F1000010000, 40, 8, "libraries"),
        (0x7F1000010000, 0x7F1000011000, 4, 4, "libraries"),
        (0x7F2000000000, 0x7F2000001000, 4, 0, "other files"),
        (0x7F3000000000, 0x7F3000100000, 16, 16, "heap and anonymous"),
    ]


def test_breakdown_of_this_process_counts_written_pool_pages_exactly(tmp_path):
    pool = lazy_zeros((64, PAGE // 4), torch.float32)  # 64 pages, one row each
    pool[3] = 1.0
    pool[10, 0] = 2.0
    pool[63, -1] = 3.0
    assert float(pool[20].sum()) == 0.0  # a read maps the shared zero page: not the pool's own memory
    b = rss_breakdown([pool])
    assert b["kv_pool_bytes"] == 64 * PAGE
    assert b["kv_pool_touched"] == 3 * PAGE
    assert b["rss"] == b["anonymous"] + b["file_backed"] > 0
    assert sum(v["rss"] for v in b["by_kind"].values()) == b["rss"]
    assert sum(v["anonymous"] for v in b["by_kind"].values()) == b["anonymous"]
    assert b["by_kind"]["libraries"]["rss"] > 0  # libtorch at least
    assert rss_breakdown([], smaps=str(tmp_path / "missing"))["rss"] is None


def test_probe_stages_and_report():
    probe = MemoryProbe()
    first = probe.mark("a")
    junk = mmap.mmap(-1, 32 << 20)  # 32 MiB of fresh pages written (a bytearray may reuse free heap pages that
    junk[:: PAGE] = b"x" * len(junk[:: PAGE])  # are resident already): raises this stage's peak
    second = probe.mark("b")
    junk.close()
    assert first.peak >= first.rss > 0 and second.peak >= second.rss
    assert probe.peak == max(first.peak, second.peak)
    if probe.per_stage:
        assert second.peak >= first.rss + (32 << 20) - (4 << 20)
    r = memory_report(probe)
    assert [s["name"] for s in r["stages"]] == ["a", "b"] and r["peak_rss"] == probe.peak
    assert r["kv_pool_bytes"] == 0 and r["kv_pool_touched"] == 0
    text = format_memory(r)
    assert "peak RSS" in text and "KV pool touched" in text and "libraries" in text


@pytest.mark.real_model
def test_generate_report_memory(capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["generate", "--prompt", "Name a planet.", "--max-tokens", "3", "--json", "--num-kv-blocks", "32",
               "--kv-cache-dtype", "float32", "--report-memory"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    m = data["memory"]
    assert [s["name"] for s in m["stages"]] == ["imports", "LLM() start-up", "generation"]
    assert m["peak_rss"] == max(s["peak"] for s in m["stages"])
    assert m["rss"] == m["anonymous"] + m["file_backed"]
    # The default model over a float32 cache (whole pages per block; the default bfloat16 one is 6 KiB, half-page
    # edges): 30 layers x K/V x 16 tokens x 3 heads x 64 x 4 bytes per block; each layer's K (V) of a
    # block is 12 KiB, three whole pages, of which a token writes 768 bytes: the pages the written tokens reach.
    assert m["kv_pool_bytes"] == 32 * 30 * 2 * 16 * 3 * 64 * 4
    written = data["summary"]["prompt_tokens"] + data["summary"]["output_tokens"] - 1  # the last token: no K/V
    pages = sum(-(-min(16, written - b) * 768 // PAGE) for b in range(0, written, 16))
    assert m["kv_pool_touched"] == 60 * pages * PAGE


def test_generate_does_not_import_the_server():
    code = ("import sys\nfrom kvserve.entrypoints.cli import main\n"
            "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'kvserve.sim.cli',"
            " 'kvserve.bench.serve') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert "--report-memory" in out
    assert out.strip().splitlines()[-1] == "[]"
