"""Strategy "recompute": forward saves q, k, v and the row statistics; backward rebuilds P.

Backward recomputes S = scale * q k^T (masked) and P = exp((S - m) - log l) one chunk
of query rows at a time, and runs explicit's backward ops on each chunk as it is
rebuilt (the chunked passes of `attngrad.strategies.common`, which "explicit"
runs on its saved P): the whole P is never held, so the rebuilt chunk is still
in cache when the backward matmuls read it.
Saved (`Recompute.saves`): stats = (m, log l), 2 * l * B*Hq*Nq bytes (l = 4, or
8 for float64; see `attngrad.core.ops` for why not lse alone), beside q, k, v
and the caller's mask.
"""

from __future__ import annotations

import torch

from attngrad.core.contract import Shapes
from attngrad.core.interface import Declaration, Problem, Saved
from attngrad.strategies.base import AttentionFunction
from attngrad.strategies.common import RowChunked, RowChunks, declare, forward_chunks

__all__ = ["Recompute", "RecomputeAttention", "strategy"]


class RecomputeAttention(AttentionFunction):
    """`AttentionFunction` of strategy "recompute" (RecomputeAttentionBackward in the graph)."""


class Recompute(RowChunked):
    """Saves the row statistics; backward rebuilds P chunk by chunk (`probabilities`)."""

    name = "recompute"
    keeps_mods = True  # backward masks the rebuilt scores again
    function = RecomputeAttention

    def saves(self, shapes: Shapes) -> Declaration:
        """stats: [B, Hq, Nq, 2] in the compute dtype."""
        return declare(shapes, "stats")

    def forward(self, problem: Problem[RowChunks]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] (input dtype) and {"stats": [B, Hq, Nq, 2]} (m, log l; compute dtype).

        explicit's chunked forward without keeping P: each chunk of P is dropped
        once O has used it, so the whole P never exists.
        """
        q = problem.q
        b, hq, nq, _ = q.shape
        hkv = problem.k.shape[1]
        stats = torch.empty(b, hkv, hq // hkv, nq, 2, dtype=problem.dtype, device=q.device)
        o = forward_chunks(problem, None, stats)
        return o, {"stats": stats.view(b, hq, nq, 2)}


strategy = Recompute()
