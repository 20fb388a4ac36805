"""kvserve's one-pass RMSNorm (alone and fused with the residual add) and silu * up kernels equal PyTorch's ops
(extreme inputs included), and decline tensors they cannot take so the caller falls back."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import build
from kvserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=str(cpu_kernels.unavailable_reason()))


@pytest.mark.parametrize("rows", [1, 5, 200])  # 200 x 576 is above the threshold where rows are split over threads
def test_rms_norm_matches_torch(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=g) * 3
    x[0, :8] = 1e4  # a row with large values
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, width", [(1, 576), (5, 8), (3, 24), (200, 576)])  # 200 x 576: split over threads
def test_add_rms_norm_is_the_add_then_the_norm(rows, width):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(rows, width, generator=g) * 3
    delta = torch.randn(rows, width, generator=g)
    delta[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])
    w = torch.randn(width, generator=g)
    ref_h = h + delta
    h_before = h.clone()
    y = cpu_kernels.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, ref_h)  # updated in place with PyTorch's sum, bit for bit
    assert torch.equal(y, cpu_kernels.rms_norm(ref_h, w, 1e-5))  # then exactly the one-pass norm
    torch.testing.assert_close(y, F.rms_norm(ref_h, (width,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert not torch.equal(h_before, h)
    out, h2 = torch.empty_like(h), h_before.clone()
    assert cpu_kernels.add_rms_norm(h2, delta, w, 1e-5, out) is out and torch.equal(out, y)  # into the buffer
    assert cpu_kernels.add_rms_norm(h_before, delta, w, 1e-5, torch.empty(rows, width + 8)).shape == y.shape  # misfit


def test_element_wise_ops_agree_between_the_kernel_and_pytorch_versions():
    from kvserve.layers.elementwise import CPUKernelOps, TorchOps

    g = torch.Generator().manual_seed(2)
    h, delta, w = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g), torch.randn(64, generator=g)
    kh, ky = CPUKernelOps().add_rms_norm(h.clone(), delta, w, 1e-6)
    th, ty = TorchOps().add_rms_norm(h.clone(), delta, w, 1e-6)
    assert torch.equal(kh, th)
    torch.testing.assert_close(ky, ty, rtol=1e-5, atol=1e-6)
    bad = torch.randn(7, 12, generator=g)  # width 12: the kernel declines, PyTorch runs, h is not touched
    bh, by = CPUKernelOps().add_rms_norm(bad, bad, torch.ones(12), 1e-6)
    assert torch.equal(bh, 2 * bad) and torch.equal(by, TorchOps().rms_norm(2 * bad, torch.ones(12), 1e-6))


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_silu_mul_matches_torch(rows):
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(rows, 2 * 1536, generator=g) * 4
    gu[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 30.0, 200.0])  # exp clamps at both ends, no inf/NaN
    gate, up = gu.chunk(2, dim=-1)
    out = cpu_kernels.silu_mul(gu)
    assert out.shape == (rows, 1536) and torch.isfinite(out).all()
    buf = torch.empty(rows, 1536)
    assert cpu_kernels.silu_mul(gu, buf) is buf and torch.equal(buf, out)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_kernels_decline_what_they_cannot_take():
    assert cpu_kernels.rms_norm(torch.randn(2, 12), torch.randn(12), 1e-5) is None  # 12 is not a multiple of 8
    assert cpu_kernels.rms_norm(torch.randn(2, 16).double(), torch.randn(16).double(), 1e-5) is None
    assert cpu_kernels.silu_mul(torch.randn(2, 24)) is None  # I = 12
    assert cpu_kernels.silu_mul(torch.randn(16, 2).t()) is None  # not contiguous
    h = torch.randn(2, 16)
    assert cpu_kernels.add_rms_norm(h, torch.randn(16, 2).t(), torch.randn(16), 1e-5) is None  # delta strided
    assert cpu_kernels.add_rms_norm(h, torch.randn(1, 16), torch.randn(16), 1e-5) is None  # shapes differ


def test_build_falls_back_to_the_temp_folder_when_the_cache_dir_is_unusable(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path))
    path = cpu_kernels._build()
    assert path.parent == tmp_path / f"kvserve-{__import__('os').getuid()}" and path.stat().st_size > 0
