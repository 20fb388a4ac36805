"""``Linear``: kvserve's AVX2 kernel and the oneDNN path equal the plain matmul for every row count and padded
output widths; bfloat16 and ``pack=False`` use MKL; the kernel is really in use where it can be built."""

import shutil

import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.linear import Linear


def test_kernel_is_built_and_used_on_an_avx2_machine_with_a_compiler():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("cc"):
        pytest.skip("no AVX2 or no C compiler: the fallback paths are tested below")
    assert cpu_kernels.unavailable_reason() is None
    assert Linear(torch.randn(32, 16)).path == "kvserve"


@pytest.mark.parametrize("path", ["kvserve", "onednn"])
def test_packed_paths_match_matmul_for_any_row_count(path, monkeypatch):
    if path == "kvserve" and cpu_kernels.load() is None:
        pytest.skip(cpu_kernels.unavailable_reason())
    if path == "onednn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no oneDNN in this PyTorch build")
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)  # 300 is not a multiple of the 16-feature panel: padded, then cut
    lin = Linear(w.clone())
    assert lin.path == path and lin.packed is not None and lin.weight is None
    for rows in (1, 3, 6, 7, 16, 17, 129):  # full and partial 6-row register blocks
        x = torch.randn(rows, 64, generator=g)
        out = lin(x)
        assert out.shape == (rows, 300)
        torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_kernel_packs_panels_of_16_features():
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    p = cpu_kernels.pack(w)
    assert p.shape == (2, 3, 16)  # ceil(20 / 16) panels of [K, 16]
    assert p[0, 2, 5] == w[5, 2] and p[1, 1, 3] == w[19, 1]
    assert p[1, :, 4:].abs().sum() == 0  # zero rows pad 20 features up to 32


def test_bfloat16_and_pack_false_use_the_plain_matmul():
    w = torch.randn(32, 16)
    for lin, x in ((Linear(w.bfloat16()), torch.randn(4, 16).bfloat16()), (Linear(w, pack=False), torch.randn(4, 16))):
        assert lin.packed is None and lin.path == "mkl"
        torch.testing.assert_close(lin(x), x @ lin.weight.t())
