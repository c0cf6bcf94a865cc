r"""Which keys each query row may reach: one interval per row, lo(i) <= j < hi(i).

Causal masking, sliding windows, their alignment and packed sequences all
say the same kind of thing -- query i sees a contiguous run of keys -- so
`Band` holds that run per row and every strategy masks, and skips tiles,
from it alone.

Alignment.  Query i sits at key position i + off: off = 0 aligned to the
top-left corner (SDPA's ``is_causal``), off = Nk - Nq aligned to the
bottom-right (FlashAttention 2's, what decoding with a KV cache needs: the
last query sees every key).  With a window (left, right) and/or causal
(right = 0), query i sees keys i + off - left .. i + off + right.  Causal,
Nq = 2, Nk = 4::

    top-left          bottom-right
    j:  0 1 2 3       j:  0 1 2 3
    i=0 x . . .       i=0 x x x .
    i=1 x x . .       i=1 x x x x

Packed sequences.  ``cu_seqlens_q = [0, 3, 5]``, ``cu_seqlens_k = [0, 2,
6]``: queries 0-2 attend keys 0-1 and queries 3-4 keys 2-5, with the
causal/window band and its alignment applied inside each pair (causal,
bottom-right)::

    j:   0 1 | 2 3 4 5
    i=0  . . | . . . .      segment 0: 3 queries, 2 keys; row 0 sits
    i=1  x . | . . . .      before the first key and sees nothing
    i=2  x x | . . . .
    ---------+--------
    i=3  . . | x x x .      segment 1: 2 queries, 4 keys
    i=4  . . | x x x x

A row that sees nothing gets lo = Nk, hi = 0, so it never widens a span.
Over rows that see something, lo and hi are non-decreasing (each
segment's keys come after the last one's), so the rows that see a given
key are contiguous too (`query_span`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["ALIGNMENTS", "Band"]

ALIGNMENTS = ("top-left", "bottom-right")


@dataclass(frozen=True)
class Band:
    """Per-row key intervals: query i attends keys lo[i] <= j < hi[i].

    lo, hi: int64 [Nq] on the tensors' device; seq_k = Nk.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    seq_k: int

    @staticmethod
    def of(
        seq_q: int,
        seq_k: int,
        left: int | None,
        right: int | None,
        align: str = "top-left",
        segments: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        device: torch.device | None = None,
    ) -> Band:
        """The band of a (window, causal right, alignment, packed segments) call.

        segments: (cu_seqlens_q, cu_seqlens_k) as tuples of ints [0, ..., N];
        None is one segment of everything.
        """
        cu_q, cu_k = segments if segments is not None else ((0, seq_q), (0, seq_k))
        q0, k0 = torch.tensor(cu_q[:-1]), torch.tensor(cu_k[:-1])
        len_q, len_k = torch.tensor(cu_q[1:]) - q0, torch.tensor(cu_k[1:]) - k0
        seg = torch.repeat_interleave(torch.arange(len(q0)), len_q, output_size=seq_q)
        local = torch.arange(seq_q) - q0[seg]  # the row's position inside its segment
        start, length = k0[seg], len_k[seg]
        at = local + ((length - len_q[seg]) if align == "bottom-right" else 0)  # its key position
        lo = at - left if left is not None else torch.zeros_like(at)
        hi = at + right + 1 if right is not None else length
        lo, hi = (
            start + lo.clamp(0, None).minimum(length),
            start + hi.clamp(0, None).minimum(length),
        )
        dead = lo >= hi
        lo, hi = lo.masked_fill(dead, seq_k), hi.masked_fill(dead, 0)
        return Band(lo.to(device), hi.to(device), seq_k)

    @cached_property
    def _host(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lo.cpu(), self.hi.cpu()

    def key_span(self, rows: slice) -> tuple[int, int]:
        """[c0, c1): the keys some row of ``rows`` attends (empty when none attends any)."""
        lo, hi = (t[rows] for t in self._host)
        if lo.numel() == 0:
            return 0, 0
        c0 = int(lo.min())
        return min(c0, self.seq_k), max(min(c0, self.seq_k), int(hi.max()))

    def covers(self, rows: slice, cols: slice) -> bool:
        """True when every row of ``rows`` attends every key of ``cols``."""
        lo, hi = (t[rows] for t in self._host)
        return bool(int(lo.max()) <= cols.start and int(hi.min()) >= cols.stop)

    def bias(self, rows: slice, cols: slice, like: torch.Tensor) -> torch.Tensor:
        """[r, c] in ``like``'s dtype: 0 where key j lies inside query i's interval, else -inf.

        Added to a tile of scores rather than masked_fill-ed into it: broadcast
        over the batch and heads, an add runs about ten times faster on CPU.
        """
        j = torch.arange(cols.start, cols.stop, device=like.device)
        lo = self.lo[rows].to(like.device).unsqueeze(1)
        hi = self.hi[rows].to(like.device).unsqueeze(1)
        outside = (j < lo) | (j >= hi)
        zeros = torch.zeros(outside.shape, dtype=like.dtype, device=like.device)
        return zeros.masked_fill_(outside, float("-inf"))

    def query_span(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, stop): int64 [Nk], the rows first <= i < stop that attend key j.

        Empty (first >= stop) for a key no row attends.  From the live rows'
        non-decreasing lo and hi (module docstring) by binary search.
        """
        lo, hi = self._host
        live = torch.nonzero(lo < hi).flatten()
        j = torch.arange(self.seq_k)
        if live.numel() == 0:
            empty = torch.zeros(self.seq_k, dtype=torch.int64)
            return empty.to(self.lo.device), empty.to(self.lo.device)
        lo_l, hi_l = lo[live].contiguous(), hi[live].contiguous()
        first = torch.searchsorted(hi_l, j, right=True)  # first live row with hi > j
        last = torch.searchsorted(lo_l, j, right=True) - 1  # last live row with lo <= j
        n = live.numel()
        start = torch.where(first < n, live[first.clamp(max=n - 1)], self.lo.new_tensor(0).cpu())
        stop = torch.where(last >= 0, live[last.clamp(min=0)] + 1, self.lo.new_tensor(0).cpu())
        stop = torch.where(first < n, stop, 0)
        return start.to(self.lo.device), stop.maximum(start).to(self.lo.device)
