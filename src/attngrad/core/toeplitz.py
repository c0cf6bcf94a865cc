"""Tiles constant along their diagonals, and sums along them.

A score function that adds to the score a term of (b, h, i - j) only -- ALiBi, a
relative-position table, T5's buckets -- adds to a tile of rows [r0, r0 + r) and keys
[c0, c0 + c) a Toeplitz matrix T[a, b] = x[a - b + c - 1], x the term at the r + c - 1
distances i - j from r0 - (c0 + c - 1) to (r0 + r - 1) - c0.  Its gradient is the sum of
dS' along each of the tile's diagonals.  Both cost one pass over the tile, where
evaluating the term at every score, and scattering its gradient, cost many.
"""

from __future__ import annotations

import torch

__all__ = ["diagonal_sums", "toeplitz"]


def toeplitz(x: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """T[..., a, b] = x[..., a - b + c - 1]: x [..., r + c - 1] -> T [..., r, c] (a copy)."""
    # x reversed, windows of c: W[w, b] = x[r + c - 2 - w - b]; row a of T is window r - 1 - a
    return x.flip(-1).unfold(-1, c, 1).flip(-2)


def diagonal_sums(m: torch.Tensor) -> torch.Tensor:
    """out[..., k] = sum of m[..., a, b] over a - b + c - 1 = k: m [..., r, c] -> [..., r + c - 1].

    The adjoint of `toeplitz`.  Each row a is written, reversed, at columns a .. a + c - 1
    of a zero buffer [r, r + c - 1]; the buffer's column sums are the diagonal sums.
    """
    *lead, r, c = m.shape
    n = r + c - 1
    flat = m.reshape(-1, r, c).flip(-1)  # F[a, b'] = m[a, c - 1 - b']: k = a + b'
    buffer = m.new_zeros(flat.shape[0], r, n)
    buffer.as_strided((flat.shape[0], r, c), (r * n, n + 1, 1)).copy_(flat)
    return buffer.sum(-2).view(*lead, n)
