"""Head layouts for grouped-query attention (GQA).

Query head h uses key/value head h // G, where G = Hq / Hkv (SDPA's rule).
Grouping the query heads and folding a group's rows into one row dim lets a
single matmul against the group's k serve all G heads, so k and v are never
expanded or copied:

    q: [B, Hq, Nq, d] -> [B, Hkv, G, Nq, d]          (group_heads, a view)
    rows r of each group -> [B, Hkv, G*r, d]         (take_rows)
"""

from __future__ import annotations

import torch

__all__ = ["group_heads", "take_rows"]


def group_heads(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Split the head dim: [B, H, ...] -> [B, Hkv, H/Hkv, ...] (a view).

    A head dim of size 1 (a mask shared by all heads) becomes [B, 1, 1, ...].
    """
    b, h = t.shape[:2]
    if h == 1:
        return t.unsqueeze(2)
    return t.view(b, heads_kv, h // heads_kv, *t.shape[2:])


def take_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of every group, folded: [B, Hkv, G, Nq, x] -> [B, Hkv, G*r, x].

    A view when G = 1, else a copy (the rows of one group are not adjacent to
    the next group's).
    """
    b, hkv, g, _, x = t.shape
    return t[:, :, :, rows].reshape(b, hkv, g * (rows.stop - rows.start), x)
