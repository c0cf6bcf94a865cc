"""The sliding window: query i attends key j when i - left <= j <= i + right."""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.reference import reference_attention
from helpers import TENSOR_STRATEGIES

STRATEGIES = attngrad.STRATEGIES


def band(nq: int, nk: int, left: int | None, right: int | None, causal: bool) -> torch.Tensor:
    """The window as a bool mask [Nq, Nk], built independently of attngrad.masks."""
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


def run(fn, q, k, v, mask, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.clone().requires_grad_()
        leaves.append(mask)
    out = fn(*leaves[:3], mask, **kwargs)
    grads = torch.autograd.grad(
        out, leaves, torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)
    )
    return [out, *grads]


WINDOWS = [(0, 0), (2, 1), (3, None), (None, 2), (1, 5), (30, 30)]


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize(("nq", "nk"), [(11, 11), (7, 13), (13, 5)], ids=["N11", "N7x13", "N13x5"])
def test_window_matches_reference_with_band_mask(strategy, window, causal, nq, nk):
    # Nq > Nk with a left bound leaves the last rows attending nothing (dead rows)
    q = torch.randn(2, 4, nq, 8, dtype=torch.float64)
    k = torch.randn(2, 2, nk, 8, dtype=torch.float64)
    v = torch.randn(2, 2, nk, 6, dtype=torch.float64)
    keep = band(nq, nk, *window, causal)
    want = run(reference_attention, q, k, v, keep, enable_gqa=True)
    extra = {"block_q": 3, "block_k": 4} if strategy == "flash" else {}
    got = run(
        attngrad.attention,
        q,
        k,
        v,
        None,
        is_causal=causal,
        enable_gqa=True,
        strategy=strategy,
        window=window,
        **extra,
    )
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any()
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_window_combines_with_a_mask(strategy, kind):
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    if kind == "bool":
        mask = torch.rand(1, 1, 9, 9) > 0.3
        ref_mask = mask & band(9, 9, 2, 2, False)
    else:
        mask = torch.randn(2, 9, 9, dtype=torch.float64)
        ref_mask = mask.masked_fill(~band(9, 9, 2, 2, False), float("-inf"))
    got = run(attngrad.attention, q, k, v, mask, strategy=strategy, window=(2, 2))
    want = run(reference_attention, q, k, v, ref_mask)
    # the float mask's gradient outside the band is zero in both
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_window_gradcheck(strategy):
    q, k, v = (torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    extra = {"block_q": 2, "block_k": 4} if strategy == "flash" else {}

    def fn(q, k, v):
        return attngrad.attention(q, k, v, strategy=strategy, window=(1, 2), **extra)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize(
    "window",
    [(-1, 0), (0, -2), (1,), (1, 2, 3), ("a", 1), (1.5, 2), (True, 1), 5],
    ids=str,
)
def test_bad_window_is_a_value_error_naming_it(window):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        attngrad.attention(q, q, q, window=window)
