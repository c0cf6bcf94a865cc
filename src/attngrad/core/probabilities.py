"""Tiles of the scores and of P rebuilt from the row statistics, bit for bit as forward formed them.

`masked_scores` forms a tile of S = scale q k^T with the mods applied; the
chunked forward of "explicit" and "recompute" and every P rebuilt from the
statistics (`rebuilt_probabilities`: recompute's backward; forward mode and
second order of every strategy that does not keep P) call it, so a rebuilt
tile sees the very scores its statistics were taken from.  `rebuilt_records`
forms what the derivatives of a tile's score modifications read again.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d]; G = Hq / Hkv
query heads share a key/value head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attngrad.core import ops
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.modification import Records
from attngrad.core.scores import ScoreMods

__all__ = ["ProbabilityTiles", "masked_scores", "rebuilt_probabilities", "rebuilt_records"]

# P of one tile: (rows, cols) -> [B, Hkv, G*r, c] in the compute dtype.
ProbabilityTiles = Callable[[slice, slice], torch.Tensor]


def masked_scores(
    q5: torch.Tensor, k: torch.Tensor, mods: ScoreMods, scale: float, rows: slice, cols: slice
) -> torch.Tensor:
    """Masked scores of query rows ``rows`` against keys ``cols``, in the compute dtype.

    q5: [B, Hkv, G, Nq, d] (grouped query heads), k: [B, Hkv, Nk, d] in the
    compute dtype -> S: [B, Hkv, G, r, c].
    """
    b, hkv, g = q5.shape[:3]
    r, c = rows.stop - rows.start, cols.stop - cols.start
    s = ops.scores(take_rows(q5, rows).to(k.dtype), k[:, :, cols], scale)  # (B, Hkv, G*r, c)
    return mods.apply_(s.view(b, hkv, g, r, c), rows, cols)


def rebuilt_probabilities(
    q: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, mods: ScoreMods, scale: float
) -> ProbabilityTiles:
    """Tiles of P = exp((S - m) - log l), rebuilt from stats [B, Hq, Nq, 2]: [B, Hkv, G*r, c].

    S comes from `masked_scores`, as in the chunked forward; compute dtype, fresh.
    """
    hkv = k.shape[1]
    q5, kc = group_heads(q, hkv), k.to(ops.compute_dtype(q.dtype))
    stats5 = group_heads(stats, hkv)  # (B, Hkv, G, Nq, 2)

    def p_tile(rows: slice, cols: slice) -> torch.Tensor:
        s = masked_scores(q5, kc, mods, scale, rows, cols)  # (B, Hkv, G, r, c)
        return ops.probabilities_(s, stats5[:, :, :, rows]).flatten(2, 3)

    return p_tile


def rebuilt_records(
    mods: ScoreMods,
    q_rows: torch.Tensor,
    k_tile: torch.Tensor,
    scale: float,
    rows: slice,
    cols: slice,
) -> Records | None:
    """The records of the tile (rows, cols) of ``mods.chain``, rebuilt from q k^T
    (`attngrad.core.modification.Chain.rebuilt`), or None where no modification keeps one.

    q_rows: [B, Hkv, G*r, d] (unscaled), k_tile: [B, Hkv, c, d] -> records [B, Hkv, G, r, c].
    """
    if not mods.chain.records:
        return None
    b, hkv, gr, _ = q_rows.shape
    r = rows.stop - rows.start
    s = ops.scores(q_rows, k_tile, scale)  # (B, Hkv, G*r, c)
    s5 = s.view(b, hkv, gr // r, r, s.shape[-1])  # (B, Hkv, G, r, c)
    return mods.chain.rebuilt(s5, rows, cols)
