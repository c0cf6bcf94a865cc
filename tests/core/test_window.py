"""The sliding window: query i attends key j when i - left <= j <= i + right."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import attngrad
from attngrad.verify.cases import make_inputs, outputs_and_grads
from helpers import TENSOR_STRATEGIES, assert_rule, case

STRATEGIES = attngrad.STRATEGIES


def band(nq: int, nk: int, left: int | None, right: int | None, causal: bool) -> torch.Tensor:
    """The window as a bool mask [Nq, Nk], built independently of attngrad.core.scores."""
    keep = torch.ones(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            if left is not None and j < i - left:
                keep[i, j] = False
            if right is not None and j > i + right:
                keep[i, j] = False
            if causal and j > i:
                keep[i, j] = False
    return keep


def windowed(strategy: str, **kwargs):
    """attention on ``strategy`` as an SDPA-like function for verify; ``kwargs`` (window,
    tile sizes, is_causal) override the case's."""

    def fn(q, k, v, mask, **kw):
        return attngrad.attention(q, k, v, mask, strategy=strategy, **{**kw, **kwargs})

    return fn


WINDOWS = [(0, 0), (2, 1), (3, None), (None, 2), (1, 5), (30, 30)]


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize(("nq", "nk"), [(11, 11), (7, 13), (13, 5)], ids=["N11", "N7x13", "N13x5"])
def test_window_matches_reference_with_band_mask(strategy, window, causal, nq, nk):
    # Nq > Nk with a left bound leaves the last rows attending nothing (dead rows).
    # The judge's reference sees the band as a bool mask; attention gets the window.
    c = case((2,), 4, 2, nq, nk, 8, 6, "bool", (nq, nk))
    inputs = make_inputs(c)
    inputs["mask"] = band(nq, nk, *window, causal)
    extra = {"block_q": 3, "block_k": 4} if strategy == "flash" else {}
    fn = windowed(strategy, window=window, is_causal=causal, **extra)
    got = outputs_and_grads(lambda q, k, v, mask, **kw: fn(q, k, v, None, **kw), c, inputs, c.dtype)
    assert_rule(c, inputs, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_window_combines_with_a_mask(strategy, kind):
    # the judge's reference (with its own window) and attention get the same mask
    c = case((1,), 2, 2, 9, 9, 4, 4, kind, (1, 1, 9, 9) if kind == "bool" else (2, 9, 9))
    c = dataclasses.replace(c, window=(2, 2))
    inputs = make_inputs(c)
    got = outputs_and_grads(windowed(strategy), c, inputs, c.dtype)
    assert_rule(c, inputs, got)
    if kind == "float":  # the float mask's gradient outside the band is zero
        assert (got["dmask"][..., ~band(9, 9, 2, 2, False)] == 0).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_window_gradcheck(strategy):
    # triton (Triton's interpreter: each call a program per head, gradcheck a call per input
    # element) on one head: the window is per row and key, the same in every head
    heads = 1 if strategy == "triton" else 2
    q, k, v = (
        torch.randn(1, heads, 6, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    extra = {"block_q": 2, "block_k": 4} if strategy == "flash" else {}

    def fn(q, k, v):
        return attngrad.attention(q, k, v, strategy=strategy, window=(1, 2), **extra)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize(
    ("window", "error"),
    [
        ((-1, 0), ValueError),
        ((0, -2), ValueError),
        ((1,), ValueError),
        ((1, 2, 3), ValueError),
        (5, ValueError),
        # a side of the wrong type is a TypeError that says which side
        (("a", 1), TypeError),
        ((1.5, 2), TypeError),
        ((True, 1), TypeError),
    ],
    ids=str,
)
def test_bad_window_is_an_error_naming_it(window, error):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(error, match="window"):
        attngrad.attention(q, q, q, window=window)


def test_numpy_integers_are_sizes_like_ints():
    # np.int64(4) is a positive integer: "must be a positive int, got np.int64(4)" was wrong
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    want = attngrad.attention(q, q, q, window=(2, 0), strategy="flash", block_q=4)
    got = attngrad.attention(
        q, q, q, window=(np.int64(2), 0), strategy="flash", block_q=np.int64(4)
    )
    assert torch.equal(got, want)
