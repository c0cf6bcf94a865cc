r"""An additive float bias as a score modification: x' = x + bias (a float ``attn_mask``).

The bias is [Bm, Hm, Nqm, Nkm], each dim 1 or the full size, a broadcast view
of what the caller passed (`attngrad.core.scores.split_mask`); a tile reads
its block, leaving the broadcast dims whole (`tile`).  f is linear, so::

    pullback   dx = dx',  dbias += dx' summed over the dims the bias broadcasts
    push       x'-dot = x-dot + bias-dot
    second     x-hat = x'-hat,  grad bias += x'-hat   (no curvature)

Its one tensor travels in the autograd Functions' bias place
(`attngrad.autograd.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from attngrad.core.heads import group_heads
from attngrad.core.modification import Parameters, ScoreModification

__all__ = ["Bias", "add_bias_gradient_", "tile"]

V = TypeVar("V")
_ALL = slice(None)


def tile(t: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """t[..., rows, cols], leaving broadcast (size-1) dims whole; a view."""
    return t[..., rows if t.shape[-2] > 1 else _ALL, cols if t.shape[-1] > 1 else _ALL]


def add_bias_gradient_(
    dbias: torch.Tensor, ds: torch.Tensor, rows: slice = _ALL, cols: slice = _ALL
) -> None:
    """dbias[rows, cols] += dS of one tile, summed over the dims the bias broadcasts.

    dbias: [Bm, Hm, Nqm, Nkm]; ds: [B, Hkv, G, r, c], the tile's dS.
    """
    b, hkv, g, r, c = ds.shape
    db = tile(dbias, rows, cols)
    db += ds.reshape(b, hkv * g, r, c).sum_to_size(db.shape)


def _unfolded(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """A folded tile [B, Hkv, G*r, c] as [B, Hkv, G, r, c] (a view)."""
    b, hkv, gr, c = t.shape
    r = rows.stop - rows.start
    return t.view(b, hkv, gr // r, r, c)


class Bias(ScoreModification):
    """x' = x + bias (module docstring); bias: [Bm, Hm, Nqm, Nkm] float, its heads
    grouped onto ``heads_kv`` key/value heads as the scores' are (GQA)."""

    records = False

    def __init__(self, bias: torch.Tensor, heads_kv: int) -> None:
        self.bias = bias
        self.heads_kv = heads_kv

    def parameters_of(self, bias: V, captured: Sequence[V]) -> tuple[V, ...]:
        return (bias,)

    def _tile(self, t: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """The tile of ``t`` (like the bias) at the scores' [B, Hkv, G, r, c]."""
        return tile(group_heads(t, self.heads_kv), rows, cols)

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, record: torch.Tensor | None = None
    ) -> torch.Tensor:
        return s5.add_(self._tile(self.bias, rows, cols))

    def pullback_(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        grads: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        (dbias,) = grads
        if dbias is not None:
            add_bias_gradient_(dbias, _unfolded(ds, rows), rows, cols)
        return ds

    def push(
        self, record: torch.Tensor | None, rows: slice, cols: slice, s_dot: torch.Tensor,
        dots: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        (bias_dot,) = dots
        if bias_dot is None:
            return s_dot
        return (_unfolded(s_dot, rows) + self._tile(bias_dot, rows, cols)).view(s_dot.shape)

    def second(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, dots: Parameters,
        grads: Parameters,
    ) -> torch.Tensor | None:  # fmt: skip
        (grad_bias,) = grads
        if grad_bias is not None and s_hat is not None:
            add_bias_gradient_(grad_bias, _unfolded(s_hat, rows), rows, cols)
        return s_hat
