"""Attention dropout: one mask, a pure function of positions, on every strategy and pass.

With v = I (Nk = dv) the output is the dropped P itself, O = P * Z / (1 - p),
so O != 0 shows Z bit for bit.  The statistical checks bound each estimate by
a multiple of its own standard deviation (binomial or sample), never by a
tolerance fitted to a run.
"""

from __future__ import annotations

import math

import pytest
import torch

import attngrad
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from helpers import TENSOR_STRATEGIES

CPU = torch.device("cpu")
SIGMAS = 6.0  # every statistical bound: 6 standard deviations (two-sided p ~ 2e-9)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def revealed(strategy: str, p: float, seed: int, **kw: object) -> torch.Tensor:
    """Z as one strategy draws it: bool [2, 4, 23, 29], from v = I and scores all zero."""
    q = torch.zeros(2, 4, 23, 8, dtype=torch.float64)
    k = torch.zeros(2, 4, 29, 8, dtype=torch.float64)
    v = torch.eye(29, dtype=torch.float64).expand(2, 4, 29, 29)
    out = attngrad.attention(
        q, k, v, dropout_p=p, strategy=strategy, generator=generator(seed), **kw
    )
    return out != 0


def drawn(p: float, seed: int) -> Dropout:
    return Dropout(p, *draw_seed(CPU, generator(seed)))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_every_strategy_and_tiling_draws_the_one_mask(p: float) -> None:
    expected = keep_mask(drawn(p, 3), 2, 4, 23, 29, CPU)
    assert 0 < int(expected.sum()) < expected.numel()
    for strategy in TENSOR_STRATEGIES:
        assert torch.equal(revealed(strategy, p, 3), expected), strategy
    for blocks in ((4, 8), (23, 5), (7, 29)):
        got = revealed("flash", p, 3, block_q=blocks[0], block_k=blocks[1])
        assert torch.equal(got, expected), blocks


def test_the_mask_depends_on_positions_only() -> None:
    d = drawn(0.3, 1)
    whole = keep_mask(d, 2, 3, 40, 50, CPU)
    # a block seen from its own origin draws the whole mask's entries there
    part = keep_mask(d.shifted(10, 20), 2, 3, 15, 12, CPU)
    assert torch.equal(part, whole[:, :, 10:25, 20:32])
    # the sizes of the call do not move it
    assert torch.equal(keep_mask(d, 2, 3, 10, 10, CPU), whole[:, :, :10, :10])
    # so the keys a band removes leave the others' bits alone
    banded = revealed("flash", 0.3, 1, window=(3, 2), block_q=5, block_k=6)
    full = revealed("flash", 0.3, 1)
    band = attngrad.core.band.Band.of(23, 29, 3, 2)
    j = torch.arange(29)
    inside = (j >= band.lo[:, None]) & (j < band.hi[:, None])
    assert torch.equal(banded, full & inside)


def _bound(n: int, rate: float) -> float:
    return SIGMAS * math.sqrt(rate * (1 - rate) / n)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
def test_keep_rate_per_head_batch_and_seed(p: float) -> None:
    for seed in range(3):
        z = keep_mask(drawn(p, seed), 3, 4, 128, 128, CPU).double()
        per = z.mean(dim=(-2, -1))  # [B, H]
        assert (per - (1 - p)).abs().max() <= _bound(128 * 128, 1 - p)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.corrcoef(torch.stack((a, b)))[0, 1])


def test_masks_are_independent_across_heads_batches_seeds_and_neighbours() -> None:
    n = 256 * 256
    limit = SIGMAS / math.sqrt(n)  # the correlation of independent bits: sd 1/sqrt(n)
    z = keep_mask(drawn(0.5, 0), 2, 2, 256, 256, CPU)
    other_seed = keep_mask(drawn(0.5, 1), 2, 2, 256, 256, CPU)
    pairs = {
        "heads": (z[0, 0], z[0, 1]),
        "batches": (z[0, 0], z[1, 0]),
        "seeds": (z[0, 0], other_seed[0, 0]),
        "next key": (z[0, 0, :, :-1], z[0, 0, :, 1:]),
        "next query": (z[0, 0, :-1], z[0, 0, 1:]),
    }
    for name, (a, b) in pairs.items():
        assert abs(_correlation(a, b)) <= limit * 1.01, name
    # the four corners of a rectangle: their parity is a fair coin, not fixed by the hash
    a = z[0, 0]
    parity = a[:-1, :-1] ^ a[1:, :-1] ^ a[:-1, 1:] ^ a[1:, 1:]
    assert abs(float(parity.double().mean()) - 0.5) <= _bound(parity.numel(), 0.5)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_the_output_is_unbiased_in_expectation(strategy: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 6, dtype=torch.float64) for _ in range(3))
    plain = attngrad.attention(q, k, v, strategy=strategy)
    draws = torch.stack(
        [attngrad.attention(q, k, v, dropout_p=0.4, strategy=strategy) for _ in range(400)]
    )
    mean, sd = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    assert bool(((mean - plain).abs() <= SIGMAS * sd + 1e-12).all())


def test_one_draw_per_call_from_the_default_generator() -> None:
    q = torch.randn(1, 2, 9, 4)
    torch.manual_seed(7)
    first, second = (attngrad.attention(q, q, q, dropout_p=0.5) for _ in range(2))
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    assert torch.equal(attngrad.attention(q, q, q, dropout_p=0.5), first)
    # fork_rng isolates a call: the state after it is as if it never drew
    torch.manual_seed(7)
    with torch.random.fork_rng():
        attngrad.attention(q, q, q, dropout_p=0.5)
    assert torch.equal(attngrad.attention(q, q, q, dropout_p=0.5), first)
    # a generator given leaves the default one alone
    torch.manual_seed(7)
    attngrad.attention(q, q, q, dropout_p=0.5, generator=generator(1))
    assert torch.equal(attngrad.attention(q, q, q, dropout_p=0.5), first)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_p_one_gives_zeros_and_p_zero_no_dropout(strategy: str) -> None:
    q, k, v = (torch.randn(1, 2, 7, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, dropout_p=1.0, strategy=strategy)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    plain = attngrad.attention(q, k, v, strategy=strategy)
    assert torch.equal(attngrad.attention(q, k, v, dropout_p=0.0, strategy=strategy), plain)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_gradcheck_and_gradgradcheck_with_the_seed_fixed_inside(strategy: str) -> None:
    # full-mode checks perturb every element, so the sizes are small: 16 scores a head, about
    # 5 of them dropped at p = 0.3, and a bias per head
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(
            q, k, v, b, dropout_p=0.3, strategy=strategy, generator=generator(5)
        )

    assert torch.autograd.gradcheck(call, (q, k, v, bias), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(call, (q, k, v, bias))


def test_dropout_p_out_of_range_is_refused() -> None:
    q = torch.randn(1, 2, 3, 4)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p must be in"):
            attngrad.attention(q, q, q, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p"):
        attngrad.attention(q, q, q, dropout_p="0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        attngrad.attention(q, q, q, dropout_p=0.1, generator=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_batched_backward_and_jacrev_see_the_forwards_mask(strategy: str) -> None:
    # full-mode checks (batched: under vmap) perturb every element: small sizes, two batch
    # entries and heads, 16 scores a head, half of them dropped
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(q, k, v, dropout_p=0.5, strategy=strategy, generator=generator(3))

    assert torch.autograd.gradcheck(call, (q, k, v), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(call, (q, k, v), check_batched_grad=True)
    jac = torch.func.jacrev(call, argnums=2)(q, k, v)  # [2, 2, 4, 3, 2, 2, 4, 3]
    rows = torch.stack(
        [torch.autograd.grad(call(q, k, v).flatten()[i], v)[0] for i in range(0, 48, 5)]
    )
    assert torch.allclose(jac.reshape(48, *v.shape)[0:48:5], rows, rtol=0, atol=1e-14)
