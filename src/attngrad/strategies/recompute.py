"""Strategy "recompute": forward saves q, k, v and the row statistics; backward rebuilds P.

Backward recomputes S = scale * q k^T (masked) and P = exp((S - m) - log l) one chunk
of query rows at a time, and runs explicit's backward ops on each chunk as it is
rebuilt (the chunked passes of `attngrad.strategies.common`, which "explicit"
runs on its saved P): the whole P is never held, so the rebuilt chunk is still
in cache when the backward matmuls read it.
Saved (`saves`): stats = (m, log l), 2 * l * B*Hq*Nq bytes (l = 4, or 8 for
float64; see `attngrad.core.ops` for why not lse alone), beside q, k, v and the
caller's mask.
"""

from __future__ import annotations

import torch

from attngrad.core.contract import Shapes
from attngrad.core.ops import compute_dtype
from attngrad.core.scores import ScoreMods
from attngrad.strategies.base import AttentionFunction, Grads
from attngrad.strategies.common import (
    backward_chunks,
    chunk_rows,
    declare,
    forward_chunks,
    rebuilt_probabilities,
    runs_anywhere,
)

__all__ = [
    "KEEPS_MASK",
    "TILED",
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
TILED = False  # takes no block sizes: its tiles are chunks of query rows

unavailable_reason = runs_anywhere
tiles = chunk_rows  # chunks of query rows, in both passes
probabilities = rebuilt_probabilities  # P rebuilt from the saved stats, chunk by chunk


def saves(shapes: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
    """stats: [B, Hq, Nq, 2] in the compute dtype."""
    return declare(shapes, "stats")


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ScoreMods, scale: float, tiles: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """O: [B, Hq, Nq, dv] (input dtype) and {"stats": [B, Hq, Nq, 2]} (m, log l; compute dtype).

    explicit's chunked forward without keeping P: each chunk of P is dropped
    once O has used it, so the whole P never exists.
    """
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    stats = torch.empty(b, hkv, hq // hkv, nq, 2, dtype=compute_dtype(q.dtype), device=q.device)
    o = forward_chunks(q, k, v, mask, scale, tiles, None, stats)
    return o, {"stats": stats.view(b, hq, nq, 2)}


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
    """`common.backward_chunks` on chunks of P rebuilt on demand (`probabilities`)."""
    p_chunk = probabilities(q, k, saved, mask, scale)
    backward_chunks(grads, dout, dlse, q, k, v, p_chunk, mask, scale, tiles)


class RecomputeAttention(AttentionFunction):
    """`AttentionFunction` of strategy "recompute" (RecomputeAttentionBackward in the graph)."""


Function = RecomputeAttention
