"""Tile helpers shared by forward mode and the second-order backward.

Both need, tile by tile, the scores' linear map applied to a direction
(a_q, a_k, a_bias) -- the same bilinear form S = scale * q k^T + bias
differentiated once:

    L(a) = scale * (a_q k^T + q a_k^T) + a_bias          [Nq, Nk]

Forward mode applies it to the tangents (dS/dt = L(q', k', bias')); the
second-order backward to the cotangents of (dq, dk, dbias), since
<g_q, scale dS k> + <g_k, scale dS^T q> + <g_bias, dS> = <L(g), dS>.
Tiles are [B, Hkv, G*r, c] (a GQA group's rows folded, as in
`attngrad.heads`), in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attngrad.contract import Shapes
from attngrad.heads import group_heads, take_rows
from attngrad.masks import Mask
from attngrad.tiling import tile_sizes

__all__ = ["Direction", "blocks_for"]


def blocks_for(tiles: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """(block_q, block_k) for the tangent and second-order passes.

    The tiled strategies' own tiles; explicit and recompute (whose tiles are
    chunks of whole rows) and triton (whose tiles are per kernel) take
    flash's default tiles.
    """
    if isinstance(tiles, tuple):
        return tiles
    return tile_sizes(Shapes.of(q, k, v))


@dataclass
class Direction:
    """A direction (a_q, a_k, a_bias) in the scores' inputs, ready to apply tile by tile.

    a_q: scale * (like q) grouped to [B, Hkv, G, Nq, d]; a_k: scale * (like k);
    a_bias: like the bias [Bm, Hm, Nqm, Nkm], held as a `Mask` (no band) so
    it broadcasts onto tiles exactly as the bias does.  None = zero.
    """

    a_q: torch.Tensor | None
    a_k: torch.Tensor | None
    a_bias: Mask | None

    @staticmethod
    def of(
        a_q: torch.Tensor | None,
        a_k: torch.Tensor | None,
        a_bias: torch.Tensor | None,
        mask: Mask,
        scale: float,
        dtype: torch.dtype,
    ) -> Direction:
        hkv = mask.heads_kv
        # scaled once here (O(N d)), not per tile
        gq = None if a_q is None else group_heads(a_q.to(dtype) * scale, hkv)
        gk = None if a_k is None else a_k.to(dtype) * scale
        gb = None
        if a_bias is not None:
            gb = Mask(a_bias.to(dtype), None, None, None, hkv, mask.seq_q, mask.seq_k)
        return Direction(gq, gk, gb)

    @property
    def zero(self) -> bool:
        return self.a_q is None and self.a_k is None and self.a_bias is None

    def tile(
        self, q_rows: torch.Tensor, k: torch.Tensor, rows: slice, keys: slice, groups: int
    ) -> torch.Tensor:
        """L(a) on the tile (rows, keys): [B, Hkv, G*r, c].

        q_rows: [B, Hkv, G*r, d] (q's rows of the tile, unscaled); k: [B, Hkv, Nk, d].
        """
        b, hkv, gr, _ = q_rows.shape
        r, c = rows.stop - rows.start, keys.stop - keys.start
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
        if self.a_bias is not None:
            self.a_bias.apply_(out.view(b, hkv, groups, r, c), rows, keys)
        return out
