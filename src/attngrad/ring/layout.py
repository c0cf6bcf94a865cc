"""Where each rank's shard of the sequence sits, and which blocks a ring step computes.

The sequence (dim -2) of length N is cut into equal chunks:

* ``"contiguous"``: P chunks, rank r holds chunk r;
* ``"zigzag"``: 2P chunks, rank r holds chunks r and 2P-1-r, in that order.

P = 3, N = 12 (digits: the rank holding each position)::

    contiguous   0 0 0 0 | 1 1 1 1 | 2 2 2 2
    zigzag       0 0 | 1 1 | 2 2 | 2 2 | 1 1 | 0 0

With ``is_causal`` a query chunk sees the key chunks before it whole, its own
chunk causally, and nothing after it.  Under "contiguous" rank P-1 then has P
times the work of rank 0; under "zigzag" every rank pairs an early chunk with
a late one and all do the same work.

A ring step computes its (query chunk, key chunk) pairs as `Block`s, and
merges unmasked pairs that sit side by side locally into one kernel call.
Dropout draws its mask by *global* (query, key) position, so each block
carries its ``origin`` (the global position of its first row and key) and
with dropout (``positional``) only pairs that are adjacent in the global
sequence too merge: under "zigzag" rank r's chunks r and 2P-1-r are apart
unless r = P-1, and a step may then take up to four blocks instead of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attngrad.core.band import BandSpec
from attngrad.core.contract import ArgumentError
from attngrad.core.dropout import Dropout
from attngrad.core.scores import ScoreMods

__all__ = [
    "LAYOUTS",
    "Block",
    "chunks_of",
    "shard",
    "shards",
    "step_blocks",
    "unshard",
    "validate_layout",
]

LAYOUTS = ("contiguous", "zigzag")


def validate_layout(layout: object) -> str:
    """The layout name, or ValueError naming the choices."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ArgumentError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}. "
            "'zigzag' balances the causal work across ranks; 'contiguous' is the plain split."
        )
    return layout


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices ``rank`` holds, in local order (see the module docstring)."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _check_split(name: str, length: int, parts: int, layout: str, fix: str) -> int:
    if length % parts != 0:
        raise ArgumentError(
            f"{name} has sequence length {length} (dim -2), which layout={layout!r} cannot cut "
            f"into {parts} equal chunks. {fix}"
        )
    return length // parts


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a full sequence: x [..., N, d] -> [..., N/P, d] (a copy).

    >>> shard(torch.arange(8.0).view(8, 1), 0, 2, "zigzag").flatten().tolist()
    [0.0, 1.0, 6.0, 7.0]
    """
    return torch.cat(_chunks(x, rank, world, layout), dim=-2)


def shards(x: torch.Tensor, world: int, layout: str = "contiguous") -> torch.Tensor:
    """Every rank's shard of a full sequence, stacked in rank order: x [..., N, d] ->
    [P, ..., N/P, d] (one copy; ``shards(x, P, layout)[r]`` is ``shard(x, r, P, layout)``).

    >>> shards(torch.arange(8.0).view(8, 1), 2, "zigzag").flatten().tolist()
    [0.0, 1.0, 6.0, 7.0, 2.0, 3.0, 4.0, 5.0]
    """
    first = _chunks(x, 0, world, layout)  # checks x, world and layout
    pieces = [first, *(_chunks(x, r, world, layout) for r in range(1, world))]
    out = x.new_empty((world, *x.shape[:-2], x.shape[-2] // world, x.shape[-1]))
    for r, chunks in enumerate(pieces):
        torch.cat(chunks, dim=-2, out=out[r])
    return out


def _chunks(x: torch.Tensor, rank: int, world: int, layout: str) -> list[torch.Tensor]:
    """The chunks of x [..., N, d] that ``rank`` holds, in local order: views [..., m, d]."""
    validate_layout(layout)
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ArgumentError(
            f"x must be a tensor [..., N, d] with the sequence at dim -2, got {got}; "
            "unsqueeze a 1-D sequence to [N, 1]."
        )
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int):
        raise ArgumentError(f"world must be an int >= 1, got {world!r} (rank {rank!r}).")
    if not 0 <= rank < world:
        raise ArgumentError(f"rank must be in [0, {world}) for world={world}, got {rank!r}.")
    chunks = chunks_of(rank, world, layout)
    m = _check_split(
        "x",
        x.shape[-2],
        world * len(chunks),
        layout,
        f"Pad or trim it to a multiple of {world * len(chunks)}.",
    )
    return [x.narrow(-2, c * m, m) for c in chunks]


def unshard(shards: Sequence[torch.Tensor], layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order: P x [..., N/P, d] -> [..., N, d].

    The inverse of `shard`: ``unshard([shard(x, r, P, layout) for r in range(P)], layout)``
    equals x.
    """
    validate_layout(layout)
    world = len(shards)
    if world == 0:
        raise ArgumentError("shards is empty; pass one shard per rank, in rank order.")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ArgumentError(
            f"shards must all have one shape, got {[tuple(s.shape) for s in shards]}; "
            "each rank holds N/P positions of the same tensor."
        )
    per_rank = len(chunks_of(0, world, layout))
    m = _check_split(
        "each shard", shards[0].shape[-2], per_rank, layout, "Shards come from `shard`."
    )
    pieces = {
        c: s.narrow(-2, i * m, m)
        for r, s in enumerate(shards)
        for i, c in enumerate(chunks_of(r, world, layout))
    }
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=-2)


@dataclass(frozen=True)
class Block:
    """One call of the block kernel: local query ``rows`` against ``cols`` of the k/v block in hand.

    ``causal``: the two are the same global chunk, so key j is visible to query
    i iff j <= i (local indices); otherwise every key is visible.  ``origin``:
    the global positions (query, key) of local row ``rows.start`` and key
    ``cols.start``, when the rows and the keys each run on contiguously in the
    global sequence; None for a block merged across a gap (zigzag's two chunks
    of a rank are not adjacent, except rank P-1's).
    """

    rows: slice
    cols: slice
    causal: bool
    origin: tuple[int, int] | None = (0, 0)

    def score_mods(
        self, heads_kv: int, device: torch.device | None = None, dropout: Dropout | None = None
    ) -> ScoreMods:
        """The block's scores' modifiers: its band (causal, or none) and ``dropout`` moved to
        its origin.

        ``dropout`` indexes its mask by global position: the block kernel then
        draws exactly the bits single-process attention draws for these
        (query, key) pairs.  It needs a block with an origin.
        """
        seq_q, seq_k = _extent(self.rows), _extent(self.cols)
        band = BandSpec.of(None, self.causal).build(seq_q, seq_k, device)
        if dropout is not None:
            if self.origin is None:
                raise ValueError(
                    "this block spans chunks that are not adjacent in the sequence, so dropout "
                    "cannot index it by global position; build it with step_blocks(..., "
                    "positional=True)."
                )
            dropout = dropout.shifted(*self.origin)
        return ScoreMods(None, None, band, heads_kv, seq_q, seq_k, dropout=dropout)


def _extent(s: slice) -> int:
    """The length of a slice with explicit bounds."""
    return int(s.stop - s.start)


def _merged(last: Block, new: Block) -> Block | None:
    """``last`` and ``new`` as one block, when both are unmasked and form one rectangle; else None.

    The merged block keeps last's origin when ``new`` continues it in the
    global sequence too, and has none otherwise.
    """
    if last.causal or new.causal:
        return None
    if last.rows == new.rows and last.cols.stop == new.cols.start:
        rows, cols, step = last.rows, slice(last.cols.start, new.cols.stop), (0, _extent(last.cols))
    elif last.cols == new.cols and last.rows.stop == new.rows.start:
        rows, cols, step = slice(last.rows.start, new.rows.stop), last.cols, (_extent(last.rows), 0)
    else:
        return None
    origin = last.origin
    if origin is not None and new.origin != (origin[0] + step[0], origin[1] + step[1]):
        origin = None
    return Block(rows, cols, False, origin)


def _append(blocks: list[Block], new: Block, positional: bool) -> None:
    """Add ``new``, merged into the last block when they form one rectangle (`_merged`);
    with ``positional`` only when the merged block keeps an origin."""
    merged = _merged(blocks[-1], new) if blocks else None
    if merged is not None and (merged.origin is not None or not positional):
        blocks[-1] = merged
    else:
        blocks.append(new)


def step_blocks(
    rank: int,
    source: int,
    world: int,
    layout: str,
    seq_local: int,
    is_causal: bool,
    positional: bool = False,
) -> list[Block]:
    """The blocks ``rank`` computes against the k/v shard of rank ``source``.

    Each (query chunk cq, key chunk ck) pair is skipped when ck > cq under
    ``is_causal`` (entirely in the future), causal when ck == cq, and unmasked
    otherwise.  Unmasked pairs that sit side by side merge into one block, so
    without ``is_causal`` a step is a single block.  ``positional``: the
    blocks' masks depend on global positions (dropout), so pairs merge only
    when the merged block runs on contiguously in the global sequence; every
    block then has an origin.
    """
    q_chunks, k_chunks = chunks_of(rank, world, layout), chunks_of(source, world, layout)
    m = seq_local // len(q_chunks)
    blocks: list[Block] = []
    for i, cq in enumerate(q_chunks):
        row: list[Block] = []
        for j, ck in enumerate(k_chunks):
            if not (is_causal and ck > cq):
                rows, cols = slice(i * m, (i + 1) * m), slice(j * m, (j + 1) * m)
                _append(
                    row, Block(rows, cols, is_causal and ck == cq, (cq * m, ck * m)), positional
                )
        for block in row:
            _append(blocks, block, positional)
    return blocks
