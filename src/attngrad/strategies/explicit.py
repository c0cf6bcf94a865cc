"""Strategy "explicit": forward saves q, k, v and the whole probability matrix P.

Backward is the four local ops of `attngrad.core.ops` (whose docstring holds the
formulas) on the saved P.  Saved (`saves`): P beside q, k, v.

With dropout P is saved undropped and each chunk's Z is regenerated from
its hash (`attngrad.core.dropout`); with a softcap, backward rebuilds the cap's
slope from q k^T.

Both passes walk P in chunks of query rows (the strategy's tiles), through
the chunked passes it shares with "recompute" (`attngrad.strategies.common`):
P itself is written once and read once, and outside the causal/window band
it is zero and never computed.
"""

from __future__ import annotations

import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.scores import ScoreMods
from attngrad.strategies.base import AttentionFunction, Grads
from attngrad.strategies.common import (
    ProbabilityChunks,
    backward_chunks,
    chunk_rows,
    declare,
    forward_chunks,
    runs_anywhere,
)

__all__ = [
    "KEEPS_MASK",
    "TILED",
    "ExplicitAttention",
    "Function",
    "backward_into",
    "forward",
    "probabilities",
    "saves",
    "tiles",
    "unavailable_reason",
]

KEEPS_MASK = False  # backward reads P, which already holds the mask
TILED = False  # takes no block sizes: its tiles are chunks of query rows

unavailable_reason = runs_anywhere
tiles = chunk_rows  # chunks of query rows, in both passes


def saves(shapes: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
    """P: [B, Hq, Nq, Nk] in the input dtype, stats: [B, Hq, Nq, 2] in the compute dtype."""
    return declare(shapes, "p", "stats")


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ScoreMods, scale: float, tiles: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """O: [B, Hq, Nq, dv] and {"p": P [B, Hq, Nq, Nk], "stats": [B, Hq, Nq, 2]}.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; O and P in the
    input dtype, the row statistics (m, log l; they give lse) in the compute dtype.
    """
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    p = q.new_zeros(b, hkv, g, nq, nk) if mask.banded else q.new_empty(b, hkv, g, nq, nk)
    stats = torch.empty(b, hkv, g, nq, 2, dtype=ops.compute_dtype(q.dtype), device=q.device)
    o = forward_chunks(q, k, v, mask, scale, tiles, p, stats)
    return o, {"p": p.view(b, hq, nq, nk), "stats": stats.view(b, hq, nq, 2)}


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: ScoreMods,
    scale: float,
) -> ProbabilityChunks:
    """Tiles of the saved P: (rows, cols) -> [B, Hkv, G*r, c] in the compute dtype, read only."""
    p5 = group_heads(saved["p"], k.shape[1])
    dtype = ops.compute_dtype(q.dtype)

    def p_chunk(rows: slice, cols: slice) -> torch.Tensor:
        return take_rows(p5[..., cols], rows).to(dtype)

    return p_chunk


def backward_into(
    grads: Grads,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: ScoreMods,
    scale: float,
    tiles: int,
) -> None:
    """`common.backward_chunks` on the saved P: [B, Hq, Nq, Nk] (read, never written)."""
    p_chunk = probabilities(q, k, saved, mask, scale)
    backward_chunks(grads, dout, dlse, q, k, v, p_chunk, mask, scale, tiles)


class ExplicitAttention(AttentionFunction):
    """`AttentionFunction` of strategy "explicit" (the graph shows ExplicitAttentionBackward)."""


Function = ExplicitAttention
