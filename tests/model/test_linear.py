"""``Linear``: the oneDNN packed path equals the plain matmul for every row count; bfloat16 stays unpacked."""

import torch

from kvserve.model.linear import Linear


def test_packed_linear_matches_matmul_for_any_row_count():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    lin = Linear(w.clone())
    if torch.backends.mkldnn.is_available():
        assert lin.packed is not None and lin.weight is None
    for rows in (1, 3, 16, 17, 129):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-5, atol=1e-4)


def test_bfloat16_and_pack_false_use_the_plain_matmul():
    w = torch.randn(32, 16)
    for lin, x in ((Linear(w.bfloat16()), torch.randn(4, 16).bfloat16()), (Linear(w, pack=False), torch.randn(4, 16))):
        assert lin.packed is None
        torch.testing.assert_close(lin(x), x @ lin.weight.t())
