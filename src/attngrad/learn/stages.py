r"""The exercise's graded stages: their probes, their inputs and their right answers.

Each TODO function of the exercise is one stage.  A stage is fed the
reference's correct float64 inputs on several probes (non-square, square,
batched, d != N and d = N), so a mistake in one stage never cascades into the
next; its answer must match `ANSWERS` within `tolerance`.

This module runs inside the child process that `attngrad.learn.grade` starts,
so it imports nothing but the standard library, torch and the child's other
modules (`attngrad.learn.grade.CHILD_MODULES`; importing the ``attngrad``
package costs seconds): the parent loads them by file path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ANSWERS",
    "EPS",
    "FUNCTION_STAGES",
    "PROBES",
    "STAGES",
    "TODO_NUMBER",
    "Fn",
    "Outputs",
    "answer_scale",
    "rowsum",
    "stage_inputs",
    "tolerance",
    "transposed",
]

Tensor = torch.Tensor
Outputs = tuple[Tensor, ...]
Fn = Callable[..., Any]

FUNCTION_STAGES = (
    "value_gradient",
    "probability_gradient",
    "softmax_backward",
    "query_key_gradients",
)
STAGES = (*FUNCTION_STAGES, "CustomAttention")
TODO_NUMBER = {name: i + 1 for i, name in enumerate(FUNCTION_STAGES)}
EPS = torch.finfo(torch.float64).eps

# (B, Nq, Nk, d, dv): non-square with d != N, square, batched, d = N, and B = 1
# (where broadcasting slips such as a lost keepdim give values instead of errors)
PROBES = (
    (2, 3, 5, 4, 6),
    (3, 5, 5, 3, 3),
    (2, 4, 4, 4, 4),
    (1, 4, 4, 4, 4),
    (1, 3, 3, 2, 5),
)


def transposed(x: Tensor) -> Tensor:
    """x with its last two dims swapped: [..., m, n] -> [..., n, m]."""
    return x.transpose(-2, -1)


def rowsum(x: Tensor) -> Tensor:
    """The sum of each row, kept as a column: [..., m, n] -> [..., m, 1]."""
    return x.sum(dim=-1, keepdim=True)


# ------------------------------------------------------------------ inputs per stage


def stage_inputs(stage: str, probe: tuple[int, ...], gen: torch.Generator) -> tuple[Any, ...]:
    """The stage's float64 arguments on one probe (B, Nq, Nk, d, dv), drawn from ``gen``:
    (P, dO), (dO, V), (P, dP) or (dS, Q, K, scale), with P a softmax of random scores."""
    b, nq, nk, d, dv = probe

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    p = torch.softmax(randn(b, nq, nk), dim=-1)
    if stage == "value_gradient":
        return (p, randn(b, nq, dv))
    if stage == "probability_gradient":
        return (randn(b, nq, dv), randn(b, nk, dv))
    if stage == "softmax_backward":
        return (p, randn(b, nq, nk))
    return (randn(b, nq, nk), randn(b, nq, d), randn(b, nk, d), 1.0 / math.sqrt(d))


# correct answers and the magnitudes their rounding error scales with
def _ref_value(p: Tensor, do: Tensor) -> Outputs:
    return (transposed(p) @ do,)


def _ref_prob(do: Tensor, v: Tensor) -> Outputs:
    return (do @ transposed(v),)


def _ref_softmax(p: Tensor, dp: Tensor) -> Outputs:
    return (p * (dp - rowsum(p * dp)),)


def _ref_qk(ds: Tensor, q: Tensor, k: Tensor, s: float) -> Outputs:
    return (s * ds @ k, s * transposed(ds) @ q)


def answer_scale(stage: str, args: tuple[Any, ...]) -> float:
    """max of |A||B| (or its softmax analogue): float64 rounding error is a few eps times this."""
    a = tuple(x.abs() if isinstance(x, Tensor) else abs(x) for x in args)
    if stage == "softmax_backward":
        p, dp = a
        out: Outputs = (p * (dp + rowsum(p * dp)),)
    else:
        out = ANSWERS[stage](*a)
    return max(float(t.max()) for t in out)


ANSWERS: dict[str, Callable[..., Outputs]] = {
    "value_gradient": _ref_value,
    "probability_gradient": _ref_prob,
    "softmax_backward": _ref_softmax,
    "query_key_gradients": _ref_qk,
}


def tolerance(bound: float, probe: tuple[int, ...]) -> float:
    """A few float64 eps times the magnitude |A||B| times the longest reduction."""
    return 16.0 * max(probe) * EPS * max(bound, 1.0)
