"""Strategy "recompute": forward saves q, k, v and the row statistics; backward rebuilds P.

Backward recomputes S = scale * q k^T (masked) and P = exp((S - m) - log l) one chunk
of query rows at a time, in the chunks explicit's backward walks, and runs
explicit's backward ops on each chunk as it is rebuilt: the whole P is never
held, so the rebuilt chunk is still in cache when the backward matmuls read it.
Saved (`saves`): stats = (m, log l), 2 * l * B*Hq*Nq bytes (l = 4, or 8 for
float64; see `attngrad.core.ops` for why not lse alone), beside q, k, v and the
caller's mask.
"""

from __future__ import annotations

import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.core.heads import group_heads
from attngrad.core.masks import Mask
from attngrad.strategies import explicit
from attngrad.strategies.base import AttentionFunction, Grads

__all__ = [
    "KEEPS_MASK",
    "Function",
    "RecomputeAttention",
    "backward_into",
    "forward",
    "probabilities",
    "saves",
    "tiles",
    "unavailable_reason",
]

KEEPS_MASK = True  # backward masks the rebuilt scores again

unavailable_reason = explicit.unavailable_reason
tiles = explicit.tiles  # explicit's chunks of query rows, in both passes


def saves(shapes: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
    """stats: [B, Hq, Nq, 2] in the compute dtype."""
    return {"stats": ((shapes.batch, shapes.heads_q, shapes.seq_q, 2), "stats")}


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float, tiles: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """O: [B, Hq, Nq, dv] and {"stats": [B, Hq, Nq, 2]}: explicit's forward without keeping P."""
    o, stats = explicit.output_and_stats(q, k, v, mask, scale, tiles)
    return o, {"stats": stats}


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: Mask,
    scale: float,
) -> explicit.ProbabilityChunks:
    """Tiles of P = exp((S - m) - log l), rebuilt from saved["stats"]: [B, Hkv, G*r, c].

    S comes from the same `explicit.masked_scores` as in forward, so it is
    bit for bit the S the statistics were taken from; compute dtype, fresh.
    """
    hkv = k.shape[1]
    q5, kc = group_heads(q, hkv), k.to(ops.compute_dtype(q.dtype))
    stats5 = group_heads(saved["stats"], hkv)  # (B, Hkv, G, Nq, 2)

    def p_chunk(rows: slice, cols: slice) -> torch.Tensor:
        s = explicit.masked_scores(q5, kc, mask, scale, rows, cols)  # (B, Hkv, G, r, c)
        return ops.probabilities_(s, stats5[:, :, :, rows]).flatten(2, 3)

    return p_chunk


def backward_into(
    grads: Grads,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: Mask,
    scale: float,
    tiles: int,
) -> None:
    """`explicit.backward_chunks` on chunks of P rebuilt on demand (`probabilities`)."""
    p_chunk = probabilities(q, k, saved, mask, scale)
    explicit.backward_chunks(grads, dout, dlse, q, k, v, p_chunk, mask, scale, tiles)


class RecomputeAttention(AttentionFunction):
    """`AttentionFunction` of strategy "recompute" (RecomputeAttentionBackward in the graph)."""


Function = RecomputeAttention
