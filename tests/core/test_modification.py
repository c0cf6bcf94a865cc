"""Score modifications (`attngrad.core.modification`): each one's tile derivatives -- pullback,
push and the second-order step -- against autograd on the plain formula, alone and chained
(softcap, then a score function, then the bias, as `ScoreMods` orders them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.func import jvp

from attngrad.core.bias import Bias
from attngrad.core.modification import Chain, ScoreModification
from attngrad.core.score_function import ScoreFunction
from attngrad.core.scores import ScoreMods
from attngrad.core.softcap import Softcap

F64 = torch.float64
B, HKV, G, N = 2, 2, 2, 12  # GQA: two query heads per key/value head
ROWS, COLS = slice(3, 8), slice(2, 9)  # a tile away from the origin: positions matter
R, C = ROWS.stop - ROWS.start, COLS.stop - COLS.start

Formula = Callable[..., torch.Tensor]  # (x [B, Hq, r, c], *theta) -> x'


def _index() -> tuple[torch.Tensor, ...]:
    """b, h, q_idx, kv_idx of the tile, broadcasting over [B, Hq, r, c]."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(HKV * G).view(1, -1, 1, 1)
    i = torch.arange(ROWS.start, ROWS.stop).view(1, 1, R, 1)
    j = torch.arange(COLS.start, COLS.stop).view(1, 1, 1, C)
    return b, h, i, j


def _softcap() -> tuple[ScoreModification, Formula, tuple[torch.Tensor, ...]]:
    return Softcap(2.5), lambda x: 2.5 * torch.tanh(x / 2.5), ()


def _bias() -> tuple[ScoreModification, Formula, tuple[torch.Tensor, ...]]:
    bias = torch.randn(1, HKV * G, N, 1, dtype=F64)  # broadcast over batch and keys

    def formula(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x + t[..., ROWS, :]

    return Bias(bias, HKV), formula, (bias,)


def _score(fn: Callable[..., torch.Tensor]) -> ScoreFunction:
    return ScoreFunction.of(fn, torch.zeros(B, HKV * G, N, 4, dtype=F64), B)


def _alibi() -> tuple[ScoreModification, Formula, tuple[torch.Tensor, ...]]:
    slopes = torch.randn(HKV * G, dtype=F64)
    f = _score(lambda s, b, h, i, j: s + slopes[h] * (j - i))
    _, h, i, j = _index()
    return f, lambda x, t: x + t[h] * (j - i), (slopes,)


def _gate() -> tuple[ScoreModification, Formula, tuple[torch.Tensor, ...]]:
    gate = torch.randn(HKV * G, dtype=F64)
    f = _score(lambda s, b, h, i, j: torch.tanh(s) * torch.sigmoid(gate[h]))
    _, h, _, _ = _index()
    return f, lambda x, t: torch.tanh(x) * torch.sigmoid(t[h]), (gate,)


MODIFICATIONS = {"softcap": _softcap, "bias": _bias, "alibi": _alibi, "gate": _gate}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(B, HKV * G, R, C)


def _check(chain: Chain, formula: Formula, theta: tuple[torch.Tensor, ...], counts: list[int]):
    """Values, pullback, push and the second-order step of ``chain`` against autograd on
    ``formula`` (x, *theta); counts: how many of theta each modification owns."""
    x = torch.randn(B, HKV, G, R, C, dtype=F64)
    ds, s_hat, x_dot = (torch.randn(B, HKV, G * R, C, dtype=F64) for _ in range(3))
    theta_dot = tuple(torch.randn_like(t) for t in theta)

    def split(values: tuple[object, ...]) -> list[tuple[object, ...]]:
        out, at = [], 0
        for n in counts:
            out.append(tuple(values[at : at + n]))
            at += n
        return out

    def f(x5: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
        return formula(_flat(x5), *t)

    records = [torch.empty_like(x) if m.records else None for m in chain.links]
    got = chain.values_(x.clone(), ROWS, COLS, records)
    torch.testing.assert_close(_flat(got), f(x, *theta), rtol=1e-12, atol=1e-12)

    # pullback: dS = J_x^T dS', dtheta = J_theta^T dS'
    leaves = [t.detach().requires_grad_() for t in (x, *theta)]
    y = f(*leaves)
    want = torch.autograd.grad(y, leaves, _flat(ds), allow_unused=True, materialize_grads=True)
    grads = [torch.zeros_like(t) for t in theta]
    pulled = chain.pullback_(ds.clone(), ROWS, COLS, list(records), split(tuple(grads)))
    torch.testing.assert_close(_flat(pulled), _flat(want[0]), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)

    # push: J (x_dot, theta_dot)
    records = chain.rebuilt(x.clone(), ROWS, COLS)
    tangents = chain.tangents(x_dot, ROWS, COLS, records, split(theta_dot))
    _, want_dot = jvp(f, (x, *theta), (x_dot.view(x.shape), *theta_dot))
    torch.testing.assert_close(_flat(tangents[-1]), want_dot, rtol=1e-12, atol=1e-12)

    # second: grad_(x, theta) of <S-hat, f> + <dS', J (x_dot, theta_dot)>, and dS = J_x^T dS'
    def objective(*a: torch.Tensor) -> torch.Tensor:
        value, along = jvp(f, a, (x_dot.view(x.shape), *theta_dot))
        return (value * _flat(s_hat)).sum() + (along * _flat(ds)).sum()

    leaves = [t.detach().requires_grad_() for t in (x, *theta)]
    want = torch.autograd.grad(objective(*leaves), leaves, materialize_grads=True)
    grads = [torch.zeros_like(t) for t in theta]
    ds_raw = ds.clone()
    got_hat = chain.second_(
        ds_raw, s_hat.clone(), ROWS, COLS, records, tangents, split(theta_dot), split(tuple(grads))
    )
    assert got_hat is not None
    torch.testing.assert_close(_flat(got_hat), _flat(want[0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_flat(ds_raw), _flat(pulled), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", MODIFICATIONS)
def test_each_modification_differentiates_as_autograd_does(name: str) -> None:
    torch.manual_seed(0)
    m, formula, theta = MODIFICATIONS[name]()
    _check(Chain((m,)), formula, theta, [len(theta)])


@pytest.mark.parametrize("score", ["alibi", "gate"])
def test_a_chain_differentiates_as_its_composition(score: str) -> None:
    torch.manual_seed(1)
    parts = [_softcap(), MODIFICATIONS[score](), _bias()]

    def composed(x: torch.Tensor, *theta: torch.Tensor) -> torch.Tensor:
        at = 0
        for _, formula, own in parts:
            x = formula(x, *theta[at : at + len(own)])
            at += len(own)
        return x

    theta = tuple(t for _, _, own in parts for t in own)
    chain = Chain(tuple(m for m, _, _ in parts))
    _check(chain, composed, theta, [len(own) for _, _, own in parts])


def test_score_mods_chain_the_keywords_in_order() -> None:
    bias = torch.zeros(1, 1, N, N, dtype=F64)
    score = _score(lambda s, b, h, i, j: s * 2)
    mods = ScoreMods(bias, None, None, HKV, N, N, softcap=3.0, score=score)
    kinds = [type(m) for m in mods.chain.links]
    assert kinds == [Softcap, ScoreFunction, Bias]
    assert mods.chain.parameters_of("dbias", ("dtheta",)) == ((), ("dtheta",), ("dbias",))
    assert ScoreMods.none(HKV, N, N).chain.links == ()
