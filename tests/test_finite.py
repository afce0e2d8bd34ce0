"""The cheap finiteness test must agree exactly with torch.isfinite(x).all()."""

import pytest
import torch

from wakefl.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_any_single_non_finite_entry_is_found(dtype, bad):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(x)
    for pos in (0, 1, 4096, 100_002):
        y = x.clone()
        y[pos] = bad
        assert not all_finite(y), (pos, bad, dtype)


def test_plus_and_minus_inf_together_are_found():
    x = torch.zeros(1000)
    x[3], x[900] = float("inf"), -float("inf")
    assert not all_finite(x)


@pytest.mark.parametrize(
    "dtype,value", [(torch.float32, 3e38), (torch.float16, 6e4), (torch.float64, 1.5e308)]
)
def test_finite_entries_whose_sum_overflows_are_finite(dtype, value):
    x = torch.full((1000,), value, dtype=dtype)
    assert not torch.isfinite(x.sum())  # the fast path cannot decide this one
    assert all_finite(x)


def test_integer_empty_and_non_contiguous_tensors():
    assert all_finite(torch.arange(10))
    assert all_finite(torch.empty(0))
    x = torch.randn(50, 40)
    x[7, 3] = float("nan")
    assert not all_finite(x.t())
    assert all_finite(x[:, 4:].t())
    assert not all_finite(torch.tensor([complex(float("nan"), 0.0)]))
