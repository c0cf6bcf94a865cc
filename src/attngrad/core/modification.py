r"""Score modifications: pointwise functions of the scores, evaluated tile by tile.

Between the scores S = scale q k^T and the mask, a call changes each score by
a chain of modifications f_1, ..., f_n, each a pointwise function of the score
with tensors theta_m of its own:

    x_0 = S,   x_m = f_m(x_{m-1}, theta_m),   S' = x_n   (then masked)

softcap (`attngrad.core.softcap.Softcap`: c tanh(x / c)), FlexAttention's
score function (`attngrad.core.score_function.ScoreFunction`) and an additive
float bias (`attngrad.core.bias.Bias`: x + bias) are such modifications, in
that order (`attngrad.core.scores.ScoreMods.chain`).  Each answers, on a tile
of its input x [B, Hkv, G, r, c] at query rows ``rows`` and key columns
``cols`` (slices with explicit bounds), the same questions
(`ScoreModification`):

    values_    x' = f(x, theta), in place; optionally its record of the tile
    pullback_  dx = dx' * df/dx in place;  dtheta += (df/dtheta)^T dx'
    push       x'-dot = df/dx * x-dot + df/dtheta * theta-dot
    second     J^T x'-hat + grad_(x, theta) <dx', J (x-dot, theta-dot)>

and `Chain` walks them: values forward, pullbacks and the second-order
steps backward, pushes forward (keeping each modification's input tangent,
which its second-order step reads).  A *record* is what a modification's
derivatives read of a tile (softcap: tanh(x / c); a score function: x
itself); `Chain.values_` fills it as the scores pass, `Chain.rebuilt` forms it
again from S.  Cotangents and tangents are [B, Hkv, G*r, c] (a GQA group's rows
folded, as in `attngrad.core.heads`).

A modification's tensors theta travel through the autograd Functions in the
bias's place or the captured tensors' (`attngrad.autograd.layout`);
`ScoreModification.parameters_of` picks its own from values laid out so
(their gradients, their tangents).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

__all__ = ["Chain", "Parameters", "Records", "ScoreModification"]

V = TypeVar("V")
# one entry per tensor of a modification: a gradient accumulator or a tangent (None: not
# wanted, or zero)
Parameters = Sequence[torch.Tensor | None]
Records = Sequence[torch.Tensor | None]  # one per modification of a chain (None: no record)


class ScoreModification(ABC):
    """A pointwise function x' = f(x, theta) of the scores (module docstring).

    x: [B, Hkv, G, r, c] (a tile); cotangents and tangents like it or folded
    [B, Hkv, G*r, c]; ``grads``: accumulators like theta (None: not wanted);
    ``dots``: theta's tangents (None: zero).
    """

    records: ClassVar[bool]  # whether its derivatives read a record of the tile

    @abstractmethod
    def parameters_of(self, bias: V, captured: Sequence[V]) -> tuple[V, ...]:
        """Its own entries of values laid out as the modifier tensors travel (one in the
        bias's place, one per captured tensor): theta's, in its order."""

    @abstractmethod
    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, record: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x' = f(x) on the tile s5 in place; ``record`` (like s5, where `records`)
        receives the tile's record, which the `pullback_` of the same tile reads next."""

    def record_(self, s5: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """The record of the tile s5 (its input, spent: it may be overwritten) without
        the values: the tile's input itself, unless the modification records another."""
        return s5

    @abstractmethod
    def pullback_(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        grads: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        """dx = dx' * df/dx in place in ``ds`` (returned); grads[n] += (df/dtheta_n)^T dx'.
        The record is the pullback's last reader: it may overwrite it."""

    @abstractmethod
    def push(
        self, record: torch.Tensor | None, rows: slice, cols: slice, s_dot: torch.Tensor,
        dots: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        """x'-dot = df/dx * s_dot + df/dtheta * theta_dot [B, Hkv, G*r, c]; s_dot is left
        as it is (the result is s_dot itself where f moves nothing)."""

    @abstractmethod
    def second(
        self, record: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, dots: Parameters,
        grads: Parameters,
    ) -> torch.Tensor | None:  # fmt: skip
        """The second-order step through f: with x'-hat = ``s_hat`` and the direction's
        (x-dot, theta-dot) = (``s_dot``, ``dots``), returns x-hat = J_x^T x'-hat +
        d/dx <dx', J (x-dot, theta-dot)> [B, Hkv, G*r, c] (None when both are zero) and adds
        theta's part into ``grads``; ``ds`` (dx') is read, not written."""


@dataclass(frozen=True)
class Chain:
    """Modifications applied in order (module docstring).  ``records``, ``grads``,
    ``dots`` and ``tangents`` hold one entry per modification."""

    links: tuple[ScoreModification, ...] = ()

    @property
    def records(self) -> bool:
        """Whether some modification's derivatives read a record of the tile."""
        return any(m.records for m in self.links)

    def parameters_of(self, bias: V, captured: Sequence[V]) -> tuple[tuple[V, ...], ...]:
        """Values laid out as the modifier tensors travel (one in the bias's place, one per
        captured tensor: gradients, tangents), one tuple per modification."""
        return tuple(m.parameters_of(bias, captured) for m in self.links)

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, records: Records | None = None
    ) -> torch.Tensor:
        """S' from S on the tile s5 [B, Hkv, G, r, c] in place; ``records``: buffers like s5
        (None where a modification keeps none) that receive the tile's records."""
        for n, m in enumerate(self.links):
            m.values_(s5, rows, cols, None if records is None else records[n])
        return s5

    def rebuilt(self, s5: torch.Tensor, rows: slice, cols: slice) -> list[torch.Tensor | None]:
        """The tile's records from its raw scores s5 [B, Hkv, G, r, c] (spent): the values
        run only as far as the last modification that keeps a record."""
        records: list[torch.Tensor | None] = [None] * len(self.links)
        if not self.records:
            return records
        last = max(n for n, m in enumerate(self.links) if m.records)
        for n, m in enumerate(self.links[:last]):
            records[n] = torch.empty_like(s5) if m.records else None
            m.values_(s5, rows, cols, records[n])
        records[last] = self.links[last].record_(s5, rows, cols)
        return records

    def pullback_(
        self, ds: torch.Tensor, rows: slice, cols: slice, records: Records | None,
        grads: Sequence[Parameters],
    ) -> torch.Tensor:  # fmt: skip
        """dS' [B, Hkv, G*r, c] carried back to dS in place; each modification's tensors'
        gradients added into ``grads``."""
        for n in reversed(range(len(self.links))):
            record = None if records is None else records[n]
            ds = self.links[n].pullback_(record, rows, cols, ds, grads[n])
        return ds

    def tangents(
        self, s_dot: torch.Tensor, rows: slice, cols: slice, records: Records | None,
        dots: Sequence[Parameters],
    ) -> list[torch.Tensor]:  # fmt: skip
        """[x_0-dot = s_dot, x_1-dot, ..., S'-dot]: the direction (s_dot; dots) pushed through
        each modification; [B, Hkv, G*r, c] each."""
        out = [s_dot]
        for n, m in enumerate(self.links):
            record = None if records is None else records[n]
            out.append(m.push(record, rows, cols, out[-1], dots[n]))
        return out

    def second_(
        self, ds: torch.Tensor, s_hat: torch.Tensor | None, rows: slice, cols: slice,
        records: Records | None, tangents: Sequence[torch.Tensor] | None,
        dots: Sequence[Parameters], grads: Sequence[Parameters],
    ) -> torch.Tensor | None:  # fmt: skip
        """The second-order pass back through the chain: S-hat (the cotangent of S', or
        None) onto S, returned; dS' onto dS in place in ``ds``.  ``tangents``: the
        direction at each modification's input (`tangents`; None: a zero direction),
        ``dots`` its parts like the modifications' tensors and ``grads`` their
        accumulators."""
        for n in reversed(range(len(self.links))):
            m, record = self.links[n], None if records is None else records[n]
            s_dot = None if tangents is None else tangents[n]
            s_hat = m.second(record, rows, cols, ds, s_hat, s_dot, dots[n], grads[n])
            m.pullback_(record, rows, cols, ds, (None,) * len(grads[n]))
        return s_hat
