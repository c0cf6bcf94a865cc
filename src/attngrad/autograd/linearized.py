"""Tile helpers shared by forward mode and the second-order backward.

Both need, tile by tile, the scores' linear map applied to a direction
(a_q, a_k, a_bias) -- the same bilinear form S = scale * q k^T + bias
differentiated once:

    L(a) = scale * (a_q k^T + q a_k^T) + a_bias          [Nq, Nk]

or, with a softcap c (scores c tanh(S_raw / c) + bias), the raw part times
the cap's slope 1 - tanh^2 before a_bias is added; with a score function f
(S' = f(S, theta)), the part so far pushed through f with the direction
a_theta of its captured tensors, J_f (L, a_theta) (`ScoreFunction.push`).

Forward mode applies it to the tangents (dS/dt = L(q', k', bias')); the
second-order backward to the cotangents of (dq, dk, dbias), since
<g_q, scale dS k> + <g_k, scale dS^T q> + <g_bias, dS> = <L(g), dS>.
Tiles are [B, Hkv, G*r, c] (a GQA group's rows folded, as in
`attngrad.core.heads`), in the compute dtype.  Both passes also need the
tile's raw scores (`attngrad.core.probabilities.raw_scores`: the softcap's
tanh, the score function's input) and dropout's multiplier Z / (1 - p)
(`dropout_multipliers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Problem, Saved, Strategy
from attngrad.core.probabilities import ProbabilityTiles, RawScores
from attngrad.core.score_function import ScoreFunction
from attngrad.core.scores import ScoreMods

__all__ = ["Direction", "Terminal", "dropout_multipliers", "tile_inputs"]


@dataclass
class Direction:
    """A direction (a_q, a_k, a_bias, a_captured) in the scores' inputs, ready to apply
    tile by tile.

    a_q: scale * (like q) grouped to [B, Hkv, G, Nq, d]; a_k: scale * (like k);
    a_bias: like the bias [Bm, Hm, Nqm, Nkm], held as a `ScoreMods` (no band) so
    it broadcasts onto tiles exactly as the bias does; a_captured: like the score
    function's captured tensors (``score``), empty when all are zero.  None = zero.
    """

    a_q: torch.Tensor | None
    a_k: torch.Tensor | None
    a_bias: ScoreMods | None
    a_captured: tuple[torch.Tensor | None, ...] = ()
    score: ScoreFunction | None = None

    @staticmethod
    def of(
        a_q: torch.Tensor | None,
        a_k: torch.Tensor | None,
        a_bias: torch.Tensor | None,
        a_captured: tuple[torch.Tensor | None, ...],
        mods: ScoreMods,
        scale: float,
        dtype: torch.dtype,
    ) -> Direction:
        hkv = mods.heads_kv
        # scaled once here (O(N d)), not per tile
        gq = None if a_q is None else group_heads(a_q.to(dtype) * scale, hkv)
        gk = None if a_k is None else a_k.to(dtype) * scale
        gb = None
        if a_bias is not None:
            gb = ScoreMods(a_bias.to(dtype), None, None, hkv, mods.seq_q, mods.seq_k)
        moved = tuple(a_captured) if any(a is not None for a in a_captured) else ()
        return Direction(gq, gk, gb, moved, mods.score)

    @property
    def zero(self) -> bool:
        return self.a_q is None and self.a_k is None and self.a_bias is None and not self.a_captured

    def raw_tile(
        self, q_rows: torch.Tensor, k: torch.Tensor, rows: slice, keys: slice
    ) -> torch.Tensor:
        """scale * (a_q k^T + q a_k^T) on the tile (rows, keys): [B, Hkv, G*r, c] (zeros if neither).

        q_rows: [B, Hkv, G*r, d] (q's rows of the tile, unscaled); k: [B, Hkv, Nk, d].
        """
        b, hkv, gr, _ = q_rows.shape
        c = keys.stop - keys.start
        out = None
        if self.a_q is not None:
            out = torch.matmul(take_rows(self.a_q, rows), k[:, :, keys].transpose(-2, -1))
        if self.a_k is not None:
            a_kt = self.a_k[:, :, keys].transpose(-2, -1)
            if out is None:
                out = torch.matmul(q_rows, a_kt)
            else:  # added inside the matmul
                out.view(-1, gr, c).baddbmm_(
                    q_rows.reshape(-1, gr, q_rows.shape[-1]), a_kt.reshape(-1, *a_kt.shape[-2:])
                )
        if out is None:
            out = torch.zeros(b, hkv, gr, c, dtype=q_rows.dtype, device=q_rows.device)
        return out

    def captured_dot(self) -> tuple[torch.Tensor | None, ...]:
        """The captures' direction, one per capture (None = zero)."""
        n = 0 if self.score is None else len(self.score.keys)
        return self.a_captured or (None,) * n

    def finish_(
        self, raw: torch.Tensor, rows: slice, keys: slice, groups: int, scores: RawScores
    ) -> torch.Tensor:
        """L(a) from `raw_tile`'s part: times a softcap's slope, through the score function
        (its push, with the captures' direction), plus a_bias; in place where it can."""
        b, hkv, gr, c = raw.shape
        if scores.slope is not None:
            raw.mul_(scores.slope)
        if self.score is not None and scores.raw is not None:
            raw = self.score.push(scores.raw, rows, keys, raw, self.captured_dot())
        if self.a_bias is not None:
            self.a_bias.apply_(raw.view(b, hkv, groups, gr // groups, c), rows, keys)
        return raw

    def tile(
        self,
        q_rows: torch.Tensor,
        k: torch.Tensor,
        rows: slice,
        keys: slice,
        groups: int,
        scores: RawScores,
    ) -> torch.Tensor:
        """L(a) on the tile (rows, keys): [B, Hkv, G*r, c]; ``scores``: the tile's
        `RawScores` (a softcap's slope, the score function's input).

        q_rows: [B, Hkv, G*r, d] (q's rows of the tile, unscaled); k: [B, Hkv, Nk, d].
        """
        return self.finish_(self.raw_tile(q_rows, k, rows, keys), rows, keys, groups, scores)


def dropout_multipliers(
    mods: ScoreMods, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype
) -> Callable[[slice, slice], torch.Tensor] | None:
    """(rows, keys) -> M = Z / (1 - p) on the tile [B, Hkv, G*r, c], or None without dropout.

    One hash per tile: the passes multiply every product that goes through
    the dropped P by the same M.
    """
    dropout = mods.dropout
    if dropout is None:
        return None
    bits = dropout.tiles(q, k, dtype)

    def multiplier(rows: slice, keys: slice) -> torch.Tensor:
        z = bits(rows, keys)
        return Dropout.apply_(torch.full(z.shape, dropout.scale, dtype=dtype, device=z.device), z)

    return multiplier


def tile_inputs(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    direction: tuple[torch.Tensor | None, ...],
) -> tuple[Direction, ProbabilityTiles, Callable[[slice, slice], torch.Tensor] | None]:
    """What both passes read tile by tile: the direction (a_q, a_k, a_bias, *a_captured)
    ready to apply, P's tiles (`Strategy.probabilities`) and dropout's multipliers (or None)."""
    p, dtype = problem, problem.dtype
    a_q, a_k, a_bias, *a_captured = direction
    ready = Direction.of(a_q, a_k, a_bias, tuple(a_captured), p.mods, p.scale, dtype)
    return ready, strategy.probabilities(p, saved), dropout_multipliers(p.mods, p.q, p.k, dtype)


class Terminal(torch.autograd.Function):
    """A Function of the derivative passes that is not differentiated again: it saves
    nothing, and its backward raises ``MISSING``, which says what is not implemented
    and what to take instead."""

    MISSING: ClassVar[str]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @classmethod
    def backward(cls, ctx: Any, *grads: Any) -> tuple[None, ...]:
        raise NotImplementedError(cls.MISSING)
