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

This module is the one place the band is decided: it checks the keywords
that state it (``window``, ``align``, a ``CausalBias`` attn_mask,
``cu_seqlens_q`` / ``cu_seqlens_k``; each error is an
`attngrad.core.contract.ArgumentError` or ``ArgumentTypeError`` that names
the argument, shows the value and suggests a fix), folds ``is_causal`` into the window's edges
(`BandSpec`), and builds the per-row intervals (`Band`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from attngrad.core.contract import ArgumentError, ArgumentTypeError, Shapes, is_int

__all__ = [
    "ALIGNMENTS",
    "Band",
    "BandSpec",
    "causal_bias_alignment",
    "validate_align",
    "validate_band",
    "validate_segments",
    "validate_window",
]

ALIGNMENTS = ("top-left", "bottom-right")

Segments = tuple[tuple[int, ...], tuple[int, ...]]

# -- checking the keywords that state the band ------------------------------------

_WINDOW_HINT = (
    "Query i attends key j when i - left <= j <= i + right; e.g. window=(128, 0) "
    "for the last 129 keys, or window=(128, None) for everything from i - 128 on."
)


def validate_window(window: object) -> tuple[int | None, int | None] | None:
    """``window=(left, right)``: ints >= 0 or None (unbounded on that side)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError(f"window must be a pair (left, right), got {window!r}. {_WINDOW_HINT}")
    bounds: list[int | None] = []
    for side, w in zip(("left", "right"), window, strict=True):
        if w is not None and not is_int(w):
            raise ArgumentTypeError(
                f"window's {side} side must be an int >= 0 or None, got {w!r} of type "
                f"{type(w).__name__} in window={window!r}. {_WINDOW_HINT}"
            )
        if w is not None and w < 0:
            raise ArgumentError(
                f"window's {side} side must be >= 0 or None, got {w} in window={window!r}. "
                + _WINDOW_HINT
            )
        bounds.append(None if w is None else int(w))
    return bounds[0], bounds[1]


def validate_align(align: object) -> str:
    """``align``: "top-left" (SDPA's) or "bottom-right" (FlashAttention 2's)."""
    if not isinstance(align, str) or align not in ALIGNMENTS:
        raise ArgumentError(
            f"align must be 'top-left' or 'bottom-right', got {align!r}. 'bottom-right' "
            "places query i at key i + Nk - Nq (decoding with a KV cache); 'top-left' at key i."
        )
    return align


def causal_bias_alignment(bias: CausalBias, shapes: Shapes, is_causal: bool, align: str) -> str:
    """The alignment an SDPA ``CausalBias`` attn_mask stands for (it means is_causal=True)."""
    if is_causal:
        raise ArgumentError(
            "attn_mask is a CausalBias and is_causal=True was given too; pass one of them "
            "(the CausalBias already makes the call causal)."
        )
    if (bias.seq_len_q, bias.seq_len_kv) != (shapes.seq_q, shapes.seq_k):
        raise ArgumentError(
            f"attn_mask is a CausalBias for seq_len_q={bias.seq_len_q}, seq_len_kv="
            f"{bias.seq_len_kv}, but query has Nq={shapes.seq_q} and key Nk={shapes.seq_k}; "
            "build it with causal_upper_left(Nq, Nk) or causal_lower_right(Nq, Nk)."
        )
    variant = "bottom-right" if bias.variant == CausalVariant.LOWER_RIGHT else "top-left"
    if align != "top-left" and align != variant:
        raise ArgumentError(
            f"attn_mask is a {variant} CausalBias but align={align!r}; drop align (the "
            "CausalBias sets the alignment) or pass is_causal=True with the alignment you want."
        )
    return variant


def _check_cu(
    name: str, cu: object, length: int, device: torch.device, read: bool = True
) -> tuple[int, ...]:
    """The cumulative lengths as ints; with ``read=False`` only the tensor's type, dtype,
    shape and device are checked (no host read: under torch.compile) and () returned."""
    if not isinstance(cu, torch.Tensor):
        raise ArgumentTypeError(
            f"{name} must be a 1-D integer torch.Tensor, got {type(cu).__name__}"
        )
    if cu.ndim != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.numel() < 2:
        raise ArgumentError(
            f"{name} must be a 1-D int32/int64 tensor [0, ..., N] of at least 2 entries, got "
            f"dtype {cu.dtype}, shape {tuple(cu.shape)}. Build it with "
            "torch.cumsum(lengths, 0) and a leading 0."
        )
    if cu.device != device:
        raise ArgumentError(f"{name} is on {cu.device} but query is on {device}; move it there.")
    if not read:
        return ()
    values = tuple(int(x) for x in cu.tolist())
    steps = [b - a for a, b in itertools.pairwise(values)]
    if values[0] != 0 or min(steps) < 0 or values[-1] != length:
        shown = list(values) if len(values) <= 12 else [*values[:6], "...", *values[-3:]]
        raise ArgumentError(
            f"{name} must start at 0, never decrease and end at the sequence length {length}, "
            f"got {shown}. It holds the cumulative segment lengths [0, n0, n0 + n1, ..., {length}]."
        )
    return values


def validate_segments(
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    shapes: Shapes,
    device: torch.device,
    read: bool = True,
) -> Segments | None:
    """Packed segments (cu_seqlens_q, cu_seqlens_k) as tuples of ints, or None.

    ``cu_seqlens_k`` may be left out when Nq == Nk (self-attention: the same
    segments); both need the same number of segments.  ``read=False`` checks
    only what needs no host read (type, dtype, shape, device, pairing) and
    returns None: under torch.compile the values are read when the op runs.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        given, missing = (
            ("cu_seqlens_q", "cu_seqlens_k")
            if cu_seqlens_k is None
            else ("cu_seqlens_k", "cu_seqlens_q")
        )
        if shapes.seq_q != shapes.seq_k or cu_seqlens_q is None:
            raise ArgumentError(
                f"{given} was given without {missing}; pass both (the same tensor when queries "
                "and keys are the same packed sequences)."
            )
        cu_seqlens_k = cu_seqlens_q
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, shapes.seq_q, device, read)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, shapes.seq_k, device, read)
    if not read:
        return None
    if len(cu_q) != len(cu_k):
        raise ArgumentError(
            f"cu_seqlens_q has {len(cu_q) - 1} segments but cu_seqlens_k has {len(cu_k) - 1}; "
            "segment s of the queries attends segment s of the keys, so they must pair up."
        )
    return cu_q, cu_k


def validate_band(
    attn_mask: object,
    is_causal: bool,
    window: object,
    align: object,
    cu_seqlens: tuple[object, object],
    shapes: Shapes,
    device: torch.device,
    read: bool = True,
) -> BandSpec:
    """The band of `attngrad.attention`'s arguments, checked (``is_causal`` already is).

    ``attn_mask``: a ``CausalBias`` makes the call causal with its own
    alignment; any other mask is no part of the band.  ``cu_seqlens``: the raw
    (cu_seqlens_q, cu_seqlens_k); with ``read=False`` (under torch.compile)
    their values are left to the op that runs the call, and the spec has no
    segments yet (the compiled route reads them in its op).
    """
    align = validate_align(align)
    if isinstance(attn_mask, CausalBias):  # SDPA's causal masks: is_causal with their alignment
        align = causal_bias_alignment(attn_mask, shapes, is_causal, align)
        is_causal = True
    edges = validate_window(window)
    segments = validate_segments(*cu_seqlens, shapes, device, read=read)
    return BandSpec.of(edges, is_causal, align, segments)


# -- the band ---------------------------------------------------------------------


@dataclass(frozen=True)
class BandSpec:
    """The band as a call states it, before its rows are laid out (`build`).

    left, right: query i, at key position p (its alignment), sees keys
    p - left .. p + right; None is unbounded on that side, and is_causal is
    folded in as right <= 0.  align: one of `ALIGNMENTS`.  segments:
    (cu_seqlens_q, cu_seqlens_k) as ints, or None for one segment of everything.
    """

    left: int | None = None
    right: int | None = None
    align: str = "top-left"
    segments: Segments | None = None

    @staticmethod
    def of(
        window: tuple[int | None, int | None] | None,
        is_causal: bool,
        align: str = "top-left",
        segments: Segments | None = None,
    ) -> BandSpec:
        """From a (checked) window and is_causal, which caps the window's right edge at 0."""
        left, right = window if window is not None else (None, None)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        return BandSpec(left, right, align, segments)

    @property
    def bounded(self) -> bool:
        """False when every query sees every key (no band to build)."""
        return self.left is not None or self.right is not None or self.segments is not None

    def build(self, seq_q: int, seq_k: int, device: torch.device | None = None) -> Band | None:
        """The per-row intervals for Nq = seq_q, Nk = seq_k on ``device``; None when unbounded."""
        if not self.bounded:
            return None
        return Band.of(seq_q, seq_k, self.left, self.right, self.align, self.segments, device)


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
        segments: Segments | None = None,
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
