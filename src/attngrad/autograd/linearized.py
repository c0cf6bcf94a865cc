"""Tile helpers shared by forward mode and the second-order backward.

Both need, tile by tile, the scores' linear map applied to a direction
(a_q, a_k, a_theta) -- the scores differentiated once:

    L(a) = J_chain (scale * (a_q k^T + q a_k^T), a_theta)          [Nq, Nk]

the raw part pushed through the chain of score modifications
(`attngrad.core.modification.Chain.tangents`: a softcap's slope, a score
function's push with the direction of its captured tensors, the bias's
direction added), a_theta being the direction's part like each
modification's tensors.

Forward mode applies it to the tangents (dS/dt = L(q', k', theta')); the
second-order backward to the cotangents of (dq, dk, dtheta), since
<g_q, scale dS k> + <g_k, scale dS^T q> + <g_theta, dtheta> = <L(g), dS>.
Tiles are [B, Hkv, G*r, c] (a GQA group's rows folded, as in
`attngrad.core.heads`), in the compute dtype.  Both passes also need the
records of the tile's modifications (`attngrad.core.probabilities.rebuilt_records`)
and dropout's multiplier Z / (1 - p) (`dropout_multipliers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Problem, Saved, Strategy
from attngrad.core.modification import Chain, Parameters, Records
from attngrad.core.probabilities import ProbabilityTiles
from attngrad.core.scores import ScoreMods

__all__ = ["Direction", "Terminal", "dropout_multipliers", "tile_inputs"]


@dataclass
class Direction:
    """A direction (a_q, a_k, a_theta) in the scores' inputs, ready to apply tile by tile.

    a_q: scale * (like q) grouped to [B, Hkv, G, Nq, d]; a_k: scale * (like k);
    dots: a_theta, one tuple per modification of ``chain``, like its tensors
    (`attngrad.core.modification.ScoreModification.parameters_of`).  None = zero.
    """

    a_q: torch.Tensor | None
    a_k: torch.Tensor | None
    dots: tuple[Parameters, ...]
    chain: Chain

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
        """From the direction's parts like q, k, the bias and the captured tensors."""
        hkv = mods.heads_kv
        # scaled once here (O(N d)), not per tile
        gq = None if a_q is None else group_heads(a_q.to(dtype) * scale, hkv)
        gk = None if a_k is None else a_k.to(dtype) * scale
        gb = None if a_bias is None else a_bias.to(dtype)
        return Direction(gq, gk, mods.chain.parameters_of(gb, a_captured), mods.chain)

    @property
    def zero(self) -> bool:
        moved = any(t is not None for dots in self.dots for t in dots)
        return self.a_q is None and self.a_k is None and not moved

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

    def tangents(
        self,
        q_rows: torch.Tensor,
        k: torch.Tensor,
        rows: slice,
        keys: slice,
        records: Records | None,
    ) -> list[torch.Tensor]:
        """The direction at each modification's input and, last, L(a) on the tile (rows,
        keys): [B, Hkv, G*r, c] each (`attngrad.core.modification.Chain.tangents`);
        ``records``: the tile's records.

        q_rows: [B, Hkv, G*r, d] (q's rows of the tile, unscaled); k: [B, Hkv, Nk, d].
        """
        raw = self.raw_tile(q_rows, k, rows, keys)
        return self.chain.tangents(raw, rows, keys, records, self.dots)


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
    direction: Sequence[torch.Tensor | None],
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
