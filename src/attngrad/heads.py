"""Head layouts for grouped-query attention (GQA), as views.

Query head h uses key/value head h // G, where G = Hq / Hkv (SDPA's rule).
Folding the G query heads of one group into the row dim lets a single
matmul against the group's k serve all of them, so k and v are never
expanded or copied:

    q: [B, Hq, Nq, d] -> [B, Hkv, G*Nq, d]     (fold_queries)
    o: [B, Hkv, G*Nq, dv] -> [B, Hq, Nq, dv]   (unfold_queries)
"""

from __future__ import annotations

import torch

__all__ = ["fold_queries", "group_heads", "take_rows", "unfold_queries"]


def group_heads(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Split the head dim: [B, H, ...] -> [B, Hkv, H/Hkv, ...] (a view).

    A head dim of size 1 (a mask shared by all heads) becomes [B, 1, 1, ...].
    """
    b, h = t.shape[:2]
    if h == 1:
        return t.unsqueeze(2)
    return t.view(b, heads_kv, h // heads_kv, *t.shape[2:])


def fold_queries(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[B, Hq, Nq, x] -> [B, Hkv, G*Nq, x]; a view when t is contiguous."""
    b, hq, n, x = t.shape
    return t.reshape(b, heads_kv, (hq // heads_kv) * n, x)


def unfold_queries(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """[B, Hkv, G*Nq, x] -> [B, Hq, Nq, x]; a view."""
    b, _, rows, x = t.shape
    return t.view(b, heads_q, rows * t.shape[1] // heads_q, x)


def take_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of every group, folded: [B, Hkv, G, Nq, x] -> [B, Hkv, G*r, x].

    A view when G = 1, else a copy (the rows of one group are not adjacent to
    the next group's).
    """
    b, hkv, g, _, x = t.shape
    return t[:, :, :, rows].reshape(b, hkv, g * (rows.stop - rows.start), x)
