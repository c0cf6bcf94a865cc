"""Tile helpers shared by forward mode and the second-order backward.

Both need, tile by tile, the scores' linear map applied to a direction
(a_q, a_k, a_bias) -- the same bilinear form S = scale * q k^T + bias
differentiated once:

    L(a) = scale * (a_q k^T + q a_k^T) + a_bias          [Nq, Nk]

or, with a softcap c (scores c tanh(S_raw / c) + bias), the raw part times
the cap's slope 1 - tanh^2 before a_bias is added.

Forward mode applies it to the tangents (dS/dt = L(q', k', bias')); the
second-order backward to the cotangents of (dq, dk, dbias), since
<g_q, scale dS k> + <g_k, scale dS^T q> + <g_bias, dS> = <L(g), dS>.
Tiles are [B, Hkv, G*r, c] (a GQA group's rows folded, as in
`attngrad.core.heads`), in the compute dtype.  Both passes also need the
softcap's tanh (`softcap_tanh`) and dropout's multiplier Z / (1 - p)
(`dropout_multipliers`) of a tile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Problem, Saved, Strategy
from attngrad.core.ops import capped_tanh
from attngrad.core.probabilities import ProbabilityTiles
from attngrad.core.scores import ScoreMods

__all__ = ["Direction", "Terminal", "dropout_multipliers", "softcap_tanh", "tile_inputs"]


@dataclass
class Direction:
    """A direction (a_q, a_k, a_bias) in the scores' inputs, ready to apply tile by tile.

    a_q: scale * (like q) grouped to [B, Hkv, G, Nq, d]; a_k: scale * (like k);
    a_bias: like the bias [Bm, Hm, Nqm, Nkm], held as a `ScoreMods` (no band) so
    it broadcasts onto tiles exactly as the bias does.  None = zero.
    """

    a_q: torch.Tensor | None
    a_k: torch.Tensor | None
    a_bias: ScoreMods | None

    @staticmethod
    def of(
        a_q: torch.Tensor | None,
        a_k: torch.Tensor | None,
        a_bias: torch.Tensor | None,
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
        return Direction(gq, gk, gb)

    @property
    def zero(self) -> bool:
        return self.a_q is None and self.a_k is None and self.a_bias is None

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

    def finish_(
        self, raw: torch.Tensor, rows: slice, keys: slice, groups: int, slope: torch.Tensor | None
    ) -> torch.Tensor:
        """L(a) from `raw_tile`'s part, in place: raw * slope (a softcap's) + a_bias."""
        b, hkv, gr, c = raw.shape
        if slope is not None:
            raw.mul_(slope)
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
        slope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """L(a) on the tile (rows, keys): [B, Hkv, G*r, c]; ``slope``: a softcap's 1 - tanh^2.

        q_rows: [B, Hkv, G*r, d] (q's rows of the tile, unscaled); k: [B, Hkv, Nk, d].
        """
        return self.finish_(self.raw_tile(q_rows, k, rows, keys), rows, keys, groups, slope)


def softcap_tanh(
    mods: ScoreMods, q_rows: torch.Tensor, k: torch.Tensor, keys: slice, scale: float
) -> torch.Tensor | None:
    """tanh(S / c) of the tile's raw scores under the mods' softcap c, or None without one."""
    if mods.softcap is None:
        return None
    return capped_tanh(q_rows, k[:, :, keys], scale, mods.softcap)


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
    direction: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> tuple[Direction, ProbabilityTiles, Callable[[slice, slice], torch.Tensor] | None]:
    """What both passes read tile by tile: the direction (a_q, a_k, a_bias) ready to apply,
    P's tiles (`Strategy.probabilities`) and dropout's multipliers (or None)."""
    p, dtype = problem, problem.dtype
    ready = Direction.of(*direction, p.mods, p.scale, dtype)
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
