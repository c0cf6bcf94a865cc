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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attngrad.band import Band
from attngrad.masks import Mask

__all__ = ["LAYOUTS", "Block", "chunks_of", "shard", "step_blocks", "unshard", "validate_layout"]

LAYOUTS = ("contiguous", "zigzag")


def validate_layout(layout: object) -> str:
    """The layout name, or ValueError naming the choices."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}. "
            "'zigzag' balances the causal work across ranks; 'contiguous' is the plain split."
        )
    return layout


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices ``rank`` holds, in local order (see the module docstring)."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _check_split(name: str, length: int, parts: int, layout: str, fix: str) -> int:
    if length % parts != 0:
        raise ValueError(
            f"{name} has sequence length {length} (dim -2), which layout={layout!r} cannot cut "
            f"into {parts} equal chunks. {fix}"
        )
    return length // parts


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a full sequence: x [..., N, d] -> [..., N/P, d] (a copy).

    >>> shard(torch.arange(8.0).view(8, 1), 0, 2, "zigzag").flatten().tolist()
    [0.0, 1.0, 6.0, 7.0]
    """
    validate_layout(layout)
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"x must be a tensor [..., N, d] with the sequence at dim -2, got {got}; "
            "unsqueeze a 1-D sequence to [N, 1]."
        )
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int):
        raise ValueError(f"world must be an int >= 1, got {world!r} (rank {rank!r}).")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}) for world={world}, got {rank!r}.")
    chunks = chunks_of(rank, world, layout)
    m = _check_split(
        "x",
        x.shape[-2],
        world * len(chunks),
        layout,
        f"Pad or trim it to a multiple of {world * len(chunks)}.",
    )
    return torch.cat([x.narrow(-2, c * m, m) for c in chunks], dim=-2)


def unshard(shards: Sequence[torch.Tensor], layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order: P x [..., N/P, d] -> [..., N, d].

    The inverse of `shard`: ``unshard([shard(x, r, P, layout) for r in range(P)], layout)``
    equals x.
    """
    validate_layout(layout)
    world = len(shards)
    if world == 0:
        raise ValueError("shards is empty; pass one shard per rank, in rank order.")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(
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
    i iff j <= i (local indices); otherwise every key is visible.
    """

    rows: slice
    cols: slice
    causal: bool

    def mask(self, heads_kv: int, device: torch.device | None = None) -> Mask:
        """The band of the block: causal (right = 0) or none."""
        seq_q, seq_k = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        band = Band.of(seq_q, seq_k, None, 0, device=device) if self.causal else None
        return Mask(None, None, band, heads_kv, seq_q, seq_k)


def _append(blocks: list[Block], new: Block) -> None:
    """Add ``new``, merged into the last block when both are unmasked and form one rectangle."""
    last = blocks[-1] if blocks else None
    if last is not None and not last.causal and not new.causal:
        if last.rows == new.rows and last.cols.stop == new.cols.start:
            blocks[-1] = Block(new.rows, slice(last.cols.start, new.cols.stop), False)
            return
        if last.cols == new.cols and last.rows.stop == new.rows.start:
            blocks[-1] = Block(slice(last.rows.start, new.rows.stop), new.cols, False)
            return
    blocks.append(new)


def step_blocks(
    rank: int, source: int, world: int, layout: str, seq_local: int, is_causal: bool
) -> list[Block]:
    """The blocks ``rank`` computes against the k/v shard of rank ``source``.

    Each (query chunk cq, key chunk ck) pair is skipped when ck > cq under
    ``is_causal`` (entirely in the future), causal when ck == cq, and unmasked
    otherwise.  Unmasked pairs that sit side by side merge into one block, so
    without ``is_causal`` a step is a single block.
    """
    q_chunks, k_chunks = chunks_of(rank, world, layout), chunks_of(source, world, layout)
    m = seq_local // len(q_chunks)
    blocks: list[Block] = []
    for i, cq in enumerate(q_chunks):
        row: list[Block] = []
        for j, ck in enumerate(k_chunks):
            if not (is_causal and ck > cq):
                _append(
                    row,
                    Block(
                        slice(i * m, (i + 1) * m), slice(j * m, (j + 1) * m), is_causal and ck == cq
                    ),
                )
        for block in row:
            _append(blocks, block)
    return blocks
