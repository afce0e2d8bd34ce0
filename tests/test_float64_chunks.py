"""The chunked float64 sums equal the whole-vector float64 forms they replace."""

import pytest
import torch

from wakefl.sdk.selffl import float64_chunks as fc

SIZES = [1, fc.CHUNK - 1, fc.CHUNK, fc.CHUNK + 1, 3 * fc.CHUNK + 17]


def _vec(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 0.1).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_sums_match_whole_vector_float64(n: int, dtype: torch.dtype) -> None:
    x, y = _vec(n, 1, dtype), _vec(n, 2, dtype)
    x64, y64 = x.double(), y.double()
    assert fc.sq_norm(x) == pytest.approx(float(x64 @ x64), rel=1e-12)
    assert fc.sq_distance(x, y) == pytest.approx(float((x64 - y64) @ (x64 - y64)), rel=1e-12)
    acc = _vec(n, 3, torch.float64)
    want = acc + 0.37 * x64
    assert torch.allclose(fc.add_scaled_(acc, x, 0.37), want, rtol=0, atol=1e-15)
    assert torch.equal(fc.widened(x), x64)


@pytest.mark.parametrize("n", SIZES)
def test_move_mean_is_one_welford_step(n: int) -> None:
    mean, x = _vec(n, 4, torch.float64), _vec(n, 5)
    delta = x.double() - mean
    want_mean = mean + delta / 3
    got = fc.move_mean_(mean, x, 1 / 3)
    assert got == pytest.approx(float(delta @ delta), rel=1e-12)
    assert torch.allclose(mean, want_mean, rtol=0, atol=1e-15)


def test_differences_near_the_float32_limit_do_not_overflow() -> None:
    x = torch.full((fc.CHUNK + 5,), 3.0e38)
    y = -x
    assert fc.sq_distance(x, y) == pytest.approx((6.0e38) ** 2 * x.numel(), rel=1e-6)


def test_mismatched_sizes_and_accumulators_are_refused() -> None:
    with pytest.raises(ValueError, match="entries"):
        fc.sq_distance(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="float64"):
        fc.add_scaled_(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="float64"):
        fc.move_mean_(torch.zeros(4, dtype=torch.float64), torch.zeros(3), 0.5)


@pytest.mark.parametrize("n", SIZES)
def test_add_difference_accumulates_and_returns_the_squared_distance(n: int) -> None:
    acc, x, y = _vec(n, 6, torch.float64), _vec(n, 7), _vec(n, 8)
    d = x.double() - y.double()
    want = acc - 0.25 * d
    assert fc.add_difference_(acc, x, y, -0.25) == pytest.approx(float(d @ d), rel=1e-12)
    assert torch.allclose(acc, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", SIZES)
def test_add_scaled_norm_adds_and_returns_the_squared_norm(n: int) -> None:
    acc, x = _vec(n, 9, torch.float64), _vec(n, 10)
    want = acc + 2.0 * x.double()
    assert fc.add_scaled_norm_(acc, x, 2.0) == pytest.approx(fc.sq_norm(x), rel=1e-12)
    assert torch.allclose(acc, want, rtol=0, atol=1e-15)
