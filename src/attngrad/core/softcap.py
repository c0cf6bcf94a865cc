r"""softcap as a score modification: x' = c tanh(x / c) (Gemma 2's attention cap).

With t = tanh(x / c), the tile's record (`attngrad.core.modification`)::

    values     x'  = c t
    slope      dx'/dx = 1 - t^2                       (`cap_slope`)
    curvature  d^2x'/dx^2 = -2 t (1 - t^2) / c

so the pullback is dx = dx' (1 - t^2), the push x'-dot = (1 - t^2) x-dot, and
the second-order step x-hat = (1 - t^2) x'-hat + x-dot dx' (-2 t (1 - t^2) / c).
It has no tensors of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from attngrad.core.modification import Parameters, ScoreModification

__all__ = ["Softcap", "cap_slope"]

V = TypeVar("V")


def cap_slope(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """1 - t^2, the slope of c tanh(x / c) from t = tanh(x / c); into ``out`` if given."""
    return torch.mul(t, t, out=out).neg_().add_(1.0)


class Softcap(ScoreModification):
    """x' = cap * tanh(x / cap) (module docstring); its record is t = tanh(x / cap)."""

    records = True

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def parameters_of(self, bias: V, captured: Sequence[V]) -> tuple[V, ...]:
        return ()

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, record: torch.Tensor | None = None
    ) -> torch.Tensor:
        if record is None:
            return s5.div_(self.cap).tanh_().mul_(self.cap)
        torch.tanh(s5.div_(self.cap), out=record)
        return torch.mul(record, self.cap, out=s5)

    def record_(self, s5: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        return s5.div_(self.cap).tanh_()

    def pullback_(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        grads: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        assert record is not None
        return ds.mul_(cap_slope(record, out=record).view(ds.shape))  # the record is spent

    def push(
        self, record: torch.Tensor | None, rows: slice, cols: slice, s_dot: torch.Tensor,
        dots: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        assert record is not None
        return s_dot * cap_slope(record).view(s_dot.shape)

    def second(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, dots: Parameters,
        grads: Parameters,
    ) -> torch.Tensor | None:  # fmt: skip
        assert record is not None
        t = record.view(ds.shape)
        slope = cap_slope(t)
        if s_hat is not None:
            s_hat.mul_(slope)
            if s_dot is not None:
                s_hat.addcmul_(s_dot * ds, t * slope, value=-2.0 / self.cap)
        elif s_dot is not None:
            s_hat = (s_dot * ds).mul_(t * slope).mul_(-2.0 / self.cap)
        return s_hat
