r"""What rounding inside a score function can do: its derivatives and a first-order error bound.

A ``score_mod`` f is a few elementwise ops on the score X and the tensor theta
it reads: T = f(X, theta).  An implementation evaluates it in its compute
dtype, each op rounding its result once.  `analyse` bounds, per score, what
those roundings do, by the first-order (linearised) error analysis of a
computational graph (Linnainmaa 1976; Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., sec. 3.1): if op k's result v_k comes out as
v_k (1 + delta_k) with |delta_k| <= w_k u, then to first order

    |T_computed - T|  <=  u  sum_k  w_k |dT / d delta_k|  =  u  sum_k  w_k |dT/dv_k| |v_k|

with w_k = 1 for the correctly rounded operations (+, -, *, /, sqrt) and
`LIBRARY_ROUNDINGS` for the rest (exp, tanh, ...: a libm or SLEEF function,
within 2 ulp = 4 u on every kernel torch dispatches to); selections, indexing,
sign changes and conversions of indices do not round (w = 0).  The
perturbations delta_k are real: `analyse` runs f under a
`torch.overrides.TorchFunctionMode` that multiplies each rounding op's result
by (1 + delta_k), delta_k a zero tensor shaped like the scores, and
autograd gives every dT / d delta_k at once -- no assumption about f beyond
the ops it calls, and nothing measured on a machine.

The same perturbations bound what the roundings do to f's derivatives, which
the implementation forms by autograd from the rounded intermediates: the
slope f' = dT/dX moves by sum_k w_k |d f' / d delta_k| u, the Jacobian
J = dT/dtheta by sum_k w_k |dJ / d delta_k| u; autograd's own backward ops
round too, one product and one local derivative per op, at most
(K + sum_k w_k) u of the derivative along each path from X (or theta) to T
(K ops; the functions here have one path each, so of the derivative itself).

Everything is float64 [B, H, Nq, Nk], evaluated over the whole grid as the
reference does (`attngrad.verify.flex_reference.over_grid`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attngrad.verify.flex_reference import over_grid

__all__ = ["EXACT_OPS", "LIBRARY_ROUNDINGS", "ROUNDED_OPS", "ScoreAnalysis", "analyse"]

# the correctly rounded IEEE operations: one rounding of at most u each
ROUNDED_OPS = frozenset({"add", "sub", "rsub", "mul", "div", "truediv", "rtruediv", "sqrt"})
# ops whose floating result is one of their inputs' values, exactly (or an index converted)
EXACT_OPS = frozenset({
    "getitem", "where", "neg", "abs", "clone", "contiguous", "view", "reshape", "expand",
    "squeeze", "unsqueeze", "clamp", "clip", "maximum", "minimum", "max", "min", "to", "float",
    "double", "type", "index_select", "gather", "take", "masked_fill", "detach", "select",
    "full_like", "zeros_like", "ones_like", "sign", "floor", "ceil", "trunc", "get",
})  # fmt: skip
# any other op: a library function within 2 ulp (4 units of roundoff) of the exact result
LIBRARY_ROUNDINGS = 4.0


def _weight(func: Any, out: object) -> float:
    """w of an op that produced ``out``: 0 if it cannot round (module docstring)."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return 0.0
    name = getattr(func, "__name__", "").strip("_")
    name = name[:-1] if name.endswith("_") else name  # in-place forms round alike
    if name in EXACT_OPS:
        return 0.0
    return 1.0 if name in ROUNDED_OPS else LIBRARY_ROUNDINGS


class _Roundings(TorchFunctionMode):
    """While a score function runs on one score: the weight of each op that rounds, and (with
    ``deltas``) its result times (1 + delta_k) for the k-th such op."""

    def __init__(self, deltas: tuple[torch.Tensor, ...] | None) -> None:
        super().__init__()
        self.deltas = deltas
        self.weights: list[float] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        w = _weight(func, out)
        if w == 0.0:
            return out
        k = len(self.weights)
        self.weights.append(w)
        if self.deltas is None:
            return out
        return out * (1 + self.deltas[k])


@dataclass(frozen=True)
class ScoreAnalysis:
    """A score function's derivatives and rounding bounds on one call's raw scores (`analyse`).

    float64, [B, H, Nq, Nk] unless said.  value: T = f(X); slope: f' = dT/dX
    (signed); curvature: |f''|; rounding: the bound on |T_computed - T| per
    unit roundoff u of the dtype f runs in; slope_rounding: on f' likewise
    (the roundings inside f and autograd's own); jacobian: J = dT/dtheta
    [B, H, Nq, Nk, *theta.shape] (None without theta); jacobian_slope:
    d f' / d theta = d J / dX, like J; jacobian_rounding: the bound on J's
    error per unit u, like J.
    """

    value: torch.Tensor
    slope: torch.Tensor
    curvature: torch.Tensor
    rounding: torch.Tensor
    slope_rounding: torch.Tensor
    jacobian: torch.Tensor | None
    jacobian_slope: torch.Tensor | None
    jacobian_rounding: torch.Tensor | None


ScoreBuilder = Callable[[torch.Tensor | None], Callable[..., torch.Tensor]]


def _evaluate(
    score: ScoreBuilder,
    x: torch.Tensor,
    theta: torch.Tensor | None,
    deltas: tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, list[float]]:
    """(T over the grid, the weights of the ops that round) with ``deltas`` in place (None: none)."""
    fn = score(theta)
    count = 0 if deltas is None else len(deltas)
    weights: list[float] = []

    def point(s: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mode = _Roundings(None if deltas is None else rest[:count])
        with mode:
            out = fn(s, *rest[count:])
        weights[:] = mode.weights
        return out

    return over_grid(point, x.shape, x.device, (x, *(deltas or ()))), weights


def analyse(score: ScoreBuilder, x: torch.Tensor, theta: torch.Tensor | None) -> ScoreAnalysis:
    """The score function ``score(theta)`` on the raw scores x [B, H, Nq, Nk] (module docstring).

    score: builds the score_mod from theta (`attngrad.verify.flex_cases.FlexScenario.score`);
    x and theta: float64.
    """
    x = x.detach().double()
    theta = None if theta is None else theta.detach().double()
    _, weights = _evaluate(score, x, theta, None)
    w = torch.tensor(weights, dtype=torch.float64)
    backward = len(weights) + float(w.sum())  # autograd's roundings per unit of a derivative
    zeros = tuple(torch.zeros_like(x) for _ in weights)

    def slope_at(xx: torch.Tensor, *deltas: torch.Tensor) -> torch.Tensor:
        """f' at the scores xx with the perturbations ``deltas`` (theta fixed)."""
        y, pull = _vjp(lambda a: _evaluate(score, a, theta, deltas)[0], xx)
        return pull(torch.ones_like(y))[0]

    def firsts(th: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(T, f', dT/d delta_k...) at theta ``th``: f is elementwise, so a vjp with ones gives
        every score's own derivative."""
        y, pull = _vjp(lambda *a: _evaluate(score, a[0], th, a[1:])[0], x, *zeros)
        return (y, *pull(torch.ones_like(y)))

    value, slope, *moves = firsts(theta)
    f1, pull_slope = _vjp(slope_at, x, *zeros)  # d/dX and d/d delta_k of f'
    curvature, *slope_moves = pull_slope(torch.ones_like(f1))
    rounding = _weighted(w, moves, value)
    slope_rounding = _weighted(w, slope_moves, value) + backward * slope.abs()
    if theta is None:
        return ScoreAnalysis(
            value, slope, curvature.abs(), rounding, slope_rounding, None, None, None
        )
    jac = torch.func.jacfwd(firsts)(theta)  # d/dtheta of (T, f', dT/d delta_k...)
    j, j_slope, *j_moves = jac
    j_rounding = _weighted(w, j_moves, j) + backward * j.abs()
    return ScoreAnalysis(
        value, slope, curvature.abs(), rounding, slope_rounding, j, j_slope, j_rounding
    )


def _vjp(
    fn: Callable[..., torch.Tensor], *primals: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]:
    """``torch.func.vjp`` of a function of tensors to one tensor: (value, pullback)."""
    out = torch.func.vjp(fn, *primals)
    return out[0], out[1]


def _weighted(w: torch.Tensor, moves: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """sum_k w_k |moves_k| (zeros like ``like`` without any op that rounds)."""
    total = torch.zeros_like(like)
    for wk, m in zip(w.tolist(), moves, strict=True):
        total = total + wk * m.abs()
    return total
