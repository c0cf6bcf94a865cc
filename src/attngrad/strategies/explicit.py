"""Strategy "explicit": forward saves q, k, v and the whole probability matrix P.

Backward is the four local ops of `attngrad.core.ops` (whose docstring holds the
formulas) on the saved P.  Saved (`Explicit.saves`): P beside q, k, v.

With dropout P is saved undropped and each chunk's Z is regenerated from
its hash (`attngrad.core.dropout`); backward rebuilds the score modifications'
records (a softcap's tanh, a score function's raw scores) from q k^T.

Both passes walk P in chunks of query rows (the strategy's tiles), through
the chunked passes it shares with "recompute" (`attngrad.strategies.common`):
P itself is written once and read once, and outside the causal/window band
it is zero and never computed.
"""

from __future__ import annotations

import torch

from attngrad.core.contract import Shapes
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Declaration, Problem, Saved
from attngrad.core.probabilities import ProbabilityTiles
from attngrad.strategies.base import AttentionFunction
from attngrad.strategies.common import RowChunked, RowChunks, declare, forward_chunks

__all__ = ["Explicit", "ExplicitAttention", "strategy"]


class ExplicitAttention(AttentionFunction):
    """`AttentionFunction` of strategy "explicit" (the graph shows ExplicitAttentionBackward)."""


class Explicit(RowChunked):
    """Saves P; backward reads it chunk by chunk."""

    name = "explicit"
    keeps_mods = False  # backward reads P, which already holds the mask
    function = ExplicitAttention

    def saves(self, shapes: Shapes) -> Declaration:
        """P: [B, Hq, Nq, Nk] in the input dtype, stats: [B, Hq, Nq, 2] in the compute dtype."""
        return declare(shapes, "p", "stats")

    def forward(self, problem: Problem[RowChunks]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] and {"p": P [B, Hq, Nq, Nk], "stats": [B, Hq, Nq, 2]}.

        O and P in the input dtype, the row statistics (m, log l; they give
        lse) in the compute dtype.
        """
        q, mods = problem.q, problem.mods
        b, hq, nq, _ = q.shape
        hkv, nk = problem.k.shape[1], problem.k.shape[2]
        g = hq // hkv
        p = q.new_zeros(b, hkv, g, nq, nk) if mods.banded else q.new_empty(b, hkv, g, nq, nk)
        stats = torch.empty(b, hkv, g, nq, 2, dtype=problem.dtype, device=q.device)
        o = forward_chunks(problem, p, stats)
        return o, {"p": p.view(b, hq, nq, nk), "stats": stats.view(b, hq, nq, 2)}

    def probabilities(self, problem: Problem[RowChunks], saved: Saved) -> ProbabilityTiles:
        """Tiles of the saved P: (rows, cols) -> [B, Hkv, G*r, c] in the compute dtype, read only."""
        p5 = group_heads(saved["p"], problem.k.shape[1])
        dtype = problem.dtype

        def p_chunk(rows: slice, cols: slice) -> torch.Tensor:
            return take_rows(p5[..., cols], rows).to(dtype)

        return p_chunk


strategy = Explicit()
