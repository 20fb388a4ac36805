"""kvserve's one-pass RMSNorm and silu * up kernels equal PyTorch's ops (extreme inputs included), and decline
tensors they cannot take so the caller falls back."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


@pytest.mark.parametrize("rows", [1, 5, 200])  # 200 x 576 is above the threshold where rows are split over threads
def test_rms_norm_matches_torch(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=g) * 3
    x[0, :8] = 1e4  # a row with large values
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_silu_mul_matches_torch(rows):
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(rows, 2 * 1536, generator=g) * 4
    gu[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 30.0, 200.0])  # exp clamps at both ends, no inf/NaN
    gate, up = gu.chunk(2, dim=-1)
    out = cpu_kernels.silu_mul(gu)
    assert out.shape == (rows, 1536) and torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_kernels_decline_what_they_cannot_take():
    assert cpu_kernels.rms_norm(torch.randn(2, 12), torch.randn(12), 1e-5) is None  # 12 is not a multiple of 8
    assert cpu_kernels.rms_norm(torch.randn(2, 16).double(), torch.randn(16).double(), 1e-5) is None
    assert cpu_kernels.silu_mul(torch.randn(2, 24)) is None  # I = 12
    assert cpu_kernels.silu_mul(torch.randn(16, 2).t()) is None  # not contiguous


def test_build_falls_back_to_the_temp_folder_when_the_cache_dir_is_unusable(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(tmp_path))
    path = cpu_kernels._build()
    assert path.parent == tmp_path / f"kvserve-{__import__('os').getuid()}" and path.stat().st_size > 0
