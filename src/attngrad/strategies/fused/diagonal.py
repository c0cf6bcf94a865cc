"""A relative score function on fused: its term along the diagonals of the scores.

A relative ``score_mod`` is ``S' = S + t(b, h, q_idx - kv_idx)`` (`ScoreFunction.relative`:
ALiBi, a relative-position table, T5's buckets): per head, a Toeplitz matrix added to the
scores.  fused takes it as

    D [B, Hq, Nq + Nk - 1],  D[b, h, j - i + Nq - 1] = t(b, h, i - j),

the term evaluated once per distance in tensor ops (O(Nq + Nk) work per head, not
O(Nq Nk)), which the kernels add to each tile row like a row of a bias, ascending with
the key.  Backward sums dS' along the same diagonals into dD; the captured tensors'
gradients follow from dD through the term's own pullback, in tensor ops again.  So a
relative function costs the kernels one vector add per score each way, whatever ops
its term is made of.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attngrad.core.score_function import TERM_KEY, ScoreFunction

__all__ = ["Diagonal"]


class Diagonal:
    """The term of a relative ``score`` at every distance of scores [B, Hq, Nq, Nk].

    ``of`` returns None where the term raises at some distance (a function valid only
    inside a BlockMask's blocks, which reads out of bounds elsewhere): the kernels then
    run it as a program, score by score, where the mask keeps scores.
    """

    def __init__(self, score: ScoreFunction, shape: tuple[int, int, int, int], dtype: torch.dtype):
        b, hq, nq, nk = shape
        # the term score by score, at no real position (no BlockMask to fall back to)
        self.term = score.term
        # zero scores at the distances i - j = -(Nk - 1) .. Nq - 1, ascending, as q_idx at
        # kv_idx 0, in tiles [B, Hkv, G, rows, columns] of one kv head
        self.zero = torch.zeros(b, 1, hq, nq + nk - 1, 1, dtype=dtype)
        self.distances = slice(-(nk - 1), nq)

    @staticmethod
    def of(
        score: ScoreFunction, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> tuple[Diagonal, torch.Tensor] | None:
        """(the diagonal, D [B, Hq, Nq + Nk - 1] in ``dtype``), or None (class docstring)."""
        if not score.relative:
            return None
        diagonal = Diagonal(score, shape, dtype)
        try:
            x = diagonal.term.values_(diagonal.zero.clone(), diagonal.distances, TERM_KEY)
        except (IndexError, RuntimeError):
            return None
        return diagonal, diagonal._flip(x)

    def pullback(self, dd: torch.Tensor, dcaptured: Sequence[torch.Tensor | None]) -> None:
        """dcaptured[n] += (dt/dtheta_n)^T dD for dD like D; None entries are not wanted."""
        dx = self._flip(dd).reshape(self.zero.shape)
        self.term.pullback_(self.zero, self.distances, TERM_KEY, dx, dcaptured)

    def second(
        self, dd: torch.Tensor, dd_hat: torch.Tensor, dots: Sequence[torch.Tensor | None],
        dcaptured: Sequence[torch.Tensor | None],
    ) -> None:  # fmt: skip
        """The term's second-order terms: dcaptured[n] += (dt/dtheta_n)^T dD-hat + d/dtheta_n
        <dD, dt/dtheta [theta-dot]>, from dD and dD-hat (dS' and S-hat summed along the
        diagonals, like D) and theta-dot = ``dots`` (the cotangents of the captured tensors'
        gradients, None for zero); None entries of ``dcaptured`` are not wanted."""
        shape = self.zero.shape
        ds, s_hat = (self._flip(x).reshape(shape) for x in (dd, dd_hat))
        self.term.second(self.zero, self.distances, TERM_KEY, ds, s_hat, None, dots, dcaptured)

    def _flip(self, x: torch.Tensor) -> torch.Tensor:
        """Ascending distance i - j <-> ascending j - i, as [B, Hq, Nq + Nk - 1]."""
        b, _, hq, n = self.zero.shape[:4]
        return x.reshape(b, hq, n).flip(-1).contiguous()
