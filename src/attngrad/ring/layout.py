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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attngrad.core.band import BandSpec
from attngrad.core.contract import ArgumentError
from attngrad.core.dropout import Dropout
from attngrad.core.scores import ScoreMods

__all__ = [
    "LAYOUTS",
    "Block",
    "balanced_layout",
    "block_work",
    "chunks_of",
    "rank_work",
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


# -- balance under a block-sparse mask ------------------------------------------------------


def block_work(spec: Any, block: int = 128, is_causal: bool = True) -> list[int]:
    """The (query block, key block) pairs each query block computes: its key blocks that
    hold a kept score.  ``spec``: packed documents' cumulative lengths [0, ..., N] (a 1-D
    int tensor or a sequence; query i sees the keys of its own document, up to its own
    with ``is_causal``) cut into blocks of ``block``, or a torch BlockMask (its partial and
    full blocks per query block, summed over its batch entries and heads; ``block`` and
    ``is_causal`` are its own then).

    >>> block_work([0, 6, 8], block=2)   # documents 0-5 and 6-7, causal
    [1, 2, 3, 1]
    """
    num = getattr(spec, "kv_num_blocks", None)
    if num is not None:
        full = spec.full_kv_num_blocks
        total = num if full is None else num + full
        return [int(x) for x in total.sum(dim=(0, 1)).tolist()]
    bounds = [int(x) for x in (spec.tolist() if isinstance(spec, torch.Tensor) else spec)]
    n = bounds[-1] if bounds else 0
    if len(bounds) < 2 or bounds[0] != 0 or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ArgumentError(
            f"cu_seqlens must rise from 0 to N, [0, ..., N], got {bounds[:8]}"
            f"{' ...' if len(bounds) > 8 else ''}."
        )
    if not isinstance(block, int) or block < 1:
        raise ArgumentError(f"block must be a positive int, got {block!r}.")
    doc = torch.zeros(n, dtype=torch.int64)  # each position's document
    starts = torch.tensor(bounds[1:-1], dtype=torch.int64)
    doc[starts[starts < n]] += 1
    doc = doc.cumsum(0)
    first = torch.tensor(bounds, dtype=torch.int64)[doc]  # each position's document start
    last = torch.tensor(bounds[1:], dtype=torch.int64)[doc] - 1  # and end
    work = []
    for r0 in range(0, n, block):
        r1 = min(r0 + block, n) - 1  # the block's rows r0 .. r1 see keys lo .. hi, one run
        lo, hi = int(first[r0]), r1 if is_causal else int(last[r1])
        work.append(hi // block - lo // block + 1)
    return work


def _fill(weights: list[int], world: int) -> list[list[int]]:
    """The blocks split into ``world`` groups of equal count, loads near equal: largest
    first into the lightest group with room, then swaps between the heaviest and the
    lightest group while they narrow the spread."""
    per = len(weights) // world
    groups: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min((r for r in range(world) if len(groups[r]) < per), key=lambda r: (loads[r], r))
        groups[r].append(i)
        loads[r] += weights[i]
    for _ in range(len(weights) ** 2):
        a, b = max(range(world), key=loads.__getitem__), min(range(world), key=loads.__getitem__)
        gap = loads[a] - loads[b]
        best = min(
            ((x, y) for x in groups[a] for y in groups[b] if 0 < weights[x] - weights[y] < gap),
            key=lambda xy: abs(gap - 2 * (weights[xy[0]] - weights[xy[1]])),
            default=None,
        )
        if best is None:
            break
        x, y = best
        groups[a][groups[a].index(x)], groups[b][groups[b].index(y)] = y, x
        moved = weights[x] - weights[y]
        loads[a], loads[b] = loads[a] - moved, loads[b] + moved
    return [sorted(g) for g in groups]


def balanced_layout(
    spec: Any, world: int, block: int = 128, is_causal: bool = True
) -> torch.Tensor:
    """A permutation of the sequence's positions that gives each of ``world`` ranks an equal
    share of the work under a block-sparse mask (`block_work`: packed documents, causal or
    not, or a BlockMask).

    Returns perm: int64 [N], whole blocks moved; rank r holds the positions
    ``perm[r N/P : (r+1) N/P]`` (its blocks in their order in the sequence): cut
    ``x.index_select(-2, perm)`` with ``shard(..., layout="contiguous")``, and build the
    mask over the permuted positions (``mask_mod(b, h, perm[i], perm[j])``).  Each rank
    computes its query blocks against every key block, so its work is the sum of its
    blocks' `block_work`; `rank_work` counts it.  Under a causal mask of packed documents,
    "zigzag" balances one document but not many of mixed lengths; this does (the blocks
    split largest first, then swapped until no swap narrows the spread).  Needs N divisible
    by ``block * world``.

    >>> perm = balanced_layout([0, 8, 12, 16], 2, block=2)   # causal documents of 8, 4, 4
    >>> rank_work([0, 8, 12, 16], 2, perm, block=2), rank_work([0, 8, 12, 16], 2, "zigzag", block=2)
    ([8, 8], [6, 10])
    """
    work = block_work(spec, block, is_causal)
    if hasattr(spec, "kv_num_blocks"):
        block = int(spec.BLOCK_SIZE[0])
        n = int(spec.seq_lengths[0])
    else:
        n = int(spec[-1])
    if not isinstance(world, int) or world < 1:
        raise ArgumentError(f"world must be an int >= 1, got {world!r}.")
    if n % (block * world):
        raise ArgumentError(
            f"balanced_layout moves whole blocks of {block} and gives each of the {world} "
            f"ranks as many, so N = {n} must be a multiple of {block * world}; pad the "
            "sequence or pick a block size that divides N / world."
        )
    order = [b for group in _fill(work, world) for b in group]
    return (torch.tensor(order, dtype=torch.int64)[:, None] * block + torch.arange(block)).flatten()


def rank_work(
    spec: Any, world: int, layout: str | torch.Tensor, block: int = 128, is_causal: bool = True
) -> list[int]:
    """Each rank's (query block, key block) pairs under ``spec`` (as `block_work`) when the
    sequence is cut by ``layout``: "contiguous", "zigzag", or a permutation of positions
    (`balanced_layout`) cut contiguously.  Blocks must not straddle two ranks' chunks.

    >>> rank_work([0, 16], 2, "contiguous", block=2), rank_work([0, 16], 2, "zigzag", block=2)
    ([10, 26], [18, 18])
    """
    work = block_work(spec, block, is_causal)
    if hasattr(spec, "kv_num_blocks"):
        block = int(spec.BLOCK_SIZE[0])
    n = len(work) * block
    positions = torch.arange(n) if isinstance(layout, str) else layout
    if isinstance(layout, str):
        positions = torch.cat([shard(positions[:, None], r, world, layout)[:, 0]
                               for r in range(world)])  # fmt: skip
    per = n // world
    if n % world or (per % block and not isinstance(layout, str)):
        raise ArgumentError(f"N = {n} does not split into {world} shards of whole blocks.")
    blocks = [sorted({int(x) // block for x in positions[r * per : (r + 1) * per].tolist()})
              for r in range(world)]  # fmt: skip
    return [sum(work[b] for b in mine) for mine in blocks]
