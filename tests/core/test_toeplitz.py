"""A relative score function's tile: a Toeplitz matrix of its term, and the diagonal sums of
the tile's gradient, its adjoint, by their definitions in float64."""

from __future__ import annotations

import pytest
import torch

from attngrad.core.toeplitz import diagonal_sums, toeplitz

SHAPES = [(1, 1), (1, 7), (7, 1), (5, 9), (9, 5), (16, 16)]


@pytest.mark.parametrize(("r", "c"), SHAPES)
def test_toeplitz_reads_x_at_a_minus_b(r: int, c: int) -> None:
    x = torch.randn(2, 3, r + c - 1, dtype=torch.float64)
    t = toeplitz(x, r, c)
    expected = torch.empty(2, 3, r, c, dtype=torch.float64)
    for a in range(r):
        for b in range(c):
            expected[..., a, b] = x[..., a - b + c - 1]
    assert torch.equal(t, expected)


@pytest.mark.parametrize(("r", "c"), SHAPES)
def test_diagonal_sums_are_toeplitz_adjoint(r: int, c: int) -> None:
    m = torch.randn(2, 3, r, c, dtype=torch.float64)
    expected = torch.stack(
        [m.diagonal(offset=c - 1 - k, dim1=-2, dim2=-1).sum(-1) for k in range(r + c - 1)], -1
    )
    sums = diagonal_sums(m)
    torch.testing.assert_close(sums, expected, rtol=1e-14, atol=1e-14)
    x = torch.randn(2, 3, r + c - 1, dtype=torch.float64)
    torch.testing.assert_close((toeplitz(x, r, c) * m).sum(), (x * sums).sum())


def test_diagonal_sums_leave_their_input_alone() -> None:
    m = torch.randn(4, 6).t()  # a non-contiguous view
    before = m.clone()
    diagonal_sums(m)
    assert torch.equal(m, before)
