"""Tiles of the score matrix: their sizes and the orders the tiled passes visit them.

Every tiled pass (flash's forward and backward, forward mode, the
second-order backward) walks [block_q, block_k] tiles of the scores, skipping
those a causal/window band masks entirely: `schedule` by blocks of query
rows (forward's order, row statistics accumulate), `key_schedule` by blocks
of keys (backward's order, dK and dV accumulate).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from attngrad.core.contract import Shapes
from attngrad.core.scores import ScoreMods

__all__ = ["Blocks", "key_schedule", "schedule", "tile_sizes"]


class Blocks(NamedTuple):
    """A tiled pass's tile: block_q query rows by block_k keys."""

    block_q: int
    block_k: int


def tile_sizes(shapes: Shapes, block_q: int | None = None, block_k: int | None = None) -> Blocks:
    """Tile sizes (block_q, block_k) of a tiled pass, unless given; never beyond Nq, Nk.

    Measured on CPU (B=1, H=8, N=4096, d=64, float32, tiles timed side by side
    in one process): 256 folded query rows (block_q * G: GQA groups share a
    key tile) by 256 keys ran forward 12% faster than 128 x 1024 without a
    mask and 25% faster with is_causal, and the key-block backward 20%
    faster; 64-row tiles pay more per-op overhead than their matmuls gain,
    2048-key tiles fall out of cache.  256 KiB of float32 scores per (batch, head).
    """
    bk = min(block_k or 256, max(shapes.seq_k, 1))
    bq = min(block_q or max(1, 256 // shapes.groups), max(shapes.seq_q, 1))
    return Blocks(bq, bk)


def schedule(mods: ScoreMods, blocks: Blocks) -> Iterator[tuple[slice, list[slice]]]:
    """The tiles to visit: each block of query rows with the key tiles it needs.

    The key tiles are the blocks of `key_schedule` (multiples of block_k) cut
    to ``mods.key_span(rows)``, those outside it (entirely masked by the band)
    left out, and so are those a BlockMask leaves empty: forward and backward then form each score in a tile of one
    shape, so with the same bits (a BLAS rounds a product by its shape, and a
    P rebuilt from other scores than the saved statistics' is not normalised).
    """
    block_q, block_k = blocks
    for r0 in range(0, mods.seq_q, block_q):
        rows = slice(r0, min(r0 + block_q, mods.seq_q))
        c_lo, c_hi = mods.key_span(rows)
        starts = range(c_lo - c_lo % block_k, c_hi, block_k) if c_lo < c_hi else range(0)
        tiles = [slice(max(c0, c_lo), min(c0 + block_k, c_hi)) for c0 in starts]
        yield rows, [cols for cols in tiles if not mods.skips(rows, cols)]


def key_schedule(
    mods: ScoreMods, blocks: Blocks
) -> Iterator[tuple[slice, list[tuple[slice, slice]]]]:
    """The tiles to visit key block by key block (backward's order).

    Yields each block of keys ``cols`` with the (rows, keys) pairs inside it:
    every block of query rows whose band reaches the block, with the part of
    ``cols`` that band allows (all of it except near a causal/window edge).
    """
    block_q, block_k = blocks
    row_blocks = [slice(r0, min(r0 + block_q, mods.seq_q)) for r0 in range(0, mods.seq_q, block_q)]
    spans = [mods.key_span(rows) for rows in row_blocks]
    for c0 in range(0, mods.seq_k, block_k):
        cols = slice(c0, min(c0 + block_k, mods.seq_k))
        pairs = []
        for rows, (lo, hi) in zip(row_blocks, spans, strict=True):
            keys = slice(max(lo, cols.start), min(hi, cols.stop))
            if keys.start < keys.stop and not mods.skips(rows, keys):
                pairs.append((rows, keys))
        yield cols, pairs
