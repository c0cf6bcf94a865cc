"""Masks in one canonical form: an additive bias, a keep mask and a causal flag.

`attention` accepts SDPA's conventions (a bool mask, True = attend; a float
mask added to the scores; ``is_causal`` aligned to the top-left corner).
`Mask.build` turns them into 4-D tensors ``[Bm, Hm, Nqm, Nkm]`` (each dim 1 or
the full size, so they stay broadcast views) that every strategy applies the
same way, to the whole score matrix or to one tile of it.

Causal, top-left aligned (query i attends key j when j <= i), Nq=3, Nk=5::

    j: 0 1 2 3 4
    i=0 x . . . .
    i=1 x x . . .
    i=2 x x x . .
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attngrad.contract import Shapes
from attngrad.heads import group_heads

__all__ = ["Mask"]

_ALL = slice(None)


def _to_4d(attn_mask: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[..., Hm, Nqm, Nkm] broadcastable to the scores -> [Bm, Hm, Nqm, Nkm].

    Bm is 1 when the mask is shared by every batch entry, else the flattened
    batch.  Only views and (where the lead dims are partly broadcast) one
    reshape: autograd carries a float mask's gradient back through them,
    summing over the dims that were broadcast.
    """
    ndim = len(shapes.score_shape)
    m = attn_mask.reshape((1,) * (ndim - attn_mask.ndim) + tuple(attn_mask.shape))
    lead = m.shape[:-3]
    if all(n == 1 for n in lead):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*shapes.lead, *m.shape[-3:]).reshape(shapes.batch, *m.shape[-3:])


def _tile(t: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """t[..., rows, cols], leaving broadcast (size-1) dims whole."""
    return t[..., rows if t.shape[-2] > 1 else _ALL, cols if t.shape[-1] > 1 else _ALL]


@dataclass(frozen=True)
class Mask:
    """What a query may attend to, for every strategy.

    bias: [Bm, Hm, Nqm, Nkm] float added to the scores, or None.
    drop: [Bm, Hm, Nqm, Nkm] bool, True where a score is masked out, or None.
    causal: query i attends key j only when j <= i (top-left aligned).
    heads_kv: key/value heads; mask heads are grouped to match (GQA).
    """

    bias: torch.Tensor | None
    drop: torch.Tensor | None
    causal: bool
    heads_kv: int

    @staticmethod
    def build(attn_mask: torch.Tensor | None, is_causal: bool, shapes: Shapes) -> Mask:
        """From SDPA-style arguments (already validated)."""
        bias = drop = None
        if attn_mask is not None:
            m = _to_4d(attn_mask, shapes)
            if m.dtype == torch.bool:
                drop = ~m
            else:
                bias = m
        return Mask(bias=bias, drop=drop, causal=is_causal, heads_kv=shapes.heads_kv)

    def with_bias(self, bias: torch.Tensor | None) -> Mask:
        """The same mask with ``bias`` in place of its own (a detached copy inside forward)."""
        return Mask(bias=bias, drop=self.drop, causal=self.causal, heads_kv=self.heads_kv)

    def apply_(self, s: torch.Tensor, rows: slice = _ALL, cols: slice = _ALL) -> torch.Tensor:
        """Mask a tile of scores in place.

        s: [B, Hkv, G, r, c], the scores of query rows ``rows`` against key
        columns ``cols`` (slices with explicit start when not whole).
        """
        if self.bias is not None:
            s.add_(_tile(group_heads(self.bias, self.heads_kv), rows, cols))
        if self.drop is not None:
            s.masked_fill_(_tile(group_heads(self.drop, self.heads_kv), rows, cols), float("-inf"))
        if self.causal:
            s.masked_fill_(self._causal_drop(s, rows, cols), float("-inf"))
        return s

    @staticmethod
    def _causal_drop(s: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """[r, c] bool, True where key index > query index."""
        r0 = rows.start or 0
        c0 = cols.start or 0
        i = torch.arange(r0, r0 + s.shape[-2], device=s.device)
        j = torch.arange(c0, c0 + s.shape[-1], device=s.device)
        return j.unsqueeze(0) > i.unsqueeze(1)

    def dead_rows(self) -> torch.Tensor | None:
        """[Bm, Hkv|1, G|1, Nqm] bool, True for query rows that attend no key.

        Computed on the masks' own (broadcast) shapes.  A causal mask alone
        leaves none dead: row i always attends key 0.
        """
        alive = None
        if self.drop is not None:
            alive = ~self.drop
        if self.bias is not None:
            finite = self.bias != float("-inf")
            alive = finite if alive is None else alive & finite
        if alive is None:
            return None
        return group_heads(~alive.any(dim=-1), self.heads_kv)
