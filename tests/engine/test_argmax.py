"""``kvserve.sample.argmax`` (NumPy on the CPU) returns what ``torch.argmax(dim=-1)`` returns: the first maximum,
NaN counting as the largest value, for every shape and layout the samplers pass."""

import pytest
import torch

from kvserve.sample.argmax import argmax


@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (3, 17), (8, 4, 100), (64, 49152)])
def test_equals_torch_on_random_rows(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
    assert torch.equal(got, x.argmax(dim=-1))


def test_ties_nan_inf_and_strided_rows():
    x = torch.zeros(6, 10)
    x[0, 3] = x[0, 7] = 5.0                        # a tie: the first
    x[1, :] = float("-inf")                        # all -inf: index 0
    x[2, 4] = float("nan")
    x[2, 8] = float("nan")                         # NaN beats everything: the first NaN
    x[3, 9] = float("inf")
    x[4, 2] = float("inf")
    x[4, 6] = float("nan")                         # NaN beats +inf too
    x[5, :] = 1.0
    expect = [3, 0, 4, 9, 6, 0]
    assert argmax(x).tolist() == expect == x.argmax(dim=-1).tolist()
    t = torch.randn(10, 6).t()                     # non-contiguous rows
    assert torch.equal(argmax(t), t.argmax(dim=-1))
    assert torch.equal(argmax(x[:, 2:]), x[:, 2:].argmax(dim=-1))
    d = torch.randn(4, 33, dtype=torch.float64)
    assert torch.equal(argmax(d), d.argmax(dim=-1))


def test_other_dtypes_fall_back_to_torch_and_results_are_writable():
    b = torch.randn(5, 40).to(torch.bfloat16)
    assert torch.equal(argmax(b), b.argmax(dim=-1))
    tokens = argmax(torch.randn(4, 9))
    tokens[1] = 3  # the sampler overwrites its sampled rows in place
    assert tokens[1] == 3
    with torch.inference_mode():
        assert argmax(torch.randn(2, 7)).shape == (2,)
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        argmax(torch.empty(3, 0))
