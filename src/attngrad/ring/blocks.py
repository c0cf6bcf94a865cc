"""The ring's unit of work, one (query block, key block) pair, and the two ways a pass walks the ring.

Rank r holds its queries and, at step s = 0 .. P-1, the k/v shard of rank r - s
(`Ring.steps`: the pairs of its query chunks and that shard's key chunks, merged
where the layout keeps them contiguous, skipped where the causal band leaves them
empty).  Each pair is one call of the block kernel (`BLOCK_STRATEGIES`, a tiled
strategy) on its problem (`block_problem`): the rows against the block's keys
with the call's keywords moved to the pair's global origin.

A pass walks the ring one of two ways:

* `circulate`: the shards travel on (forward, forward mode, the second-order
  pass's row sums); what a pair computes stays with the rows.
* `carry_home`: the shards travel on and accumulators for each shard's keys
  travel with them, each rank adding its share, until they reach the owner
  (backward's dK and dV, the second-order pass's grad k and grad v).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attngrad.core.band import Band, BandSpec
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Problem, Strategy
from attngrad.core.ops import compute_dtype
from attngrad.core.scores import ScoreMods
from attngrad.ring.comm import Exchange, RingComm
from attngrad.ring.flex_pairs import FlexPairs, Pair
from attngrad.ring.layout import Block, step_blocks
from attngrad.strategies import TILED

__all__ = [
    "BLOCK_STRATEGIES",
    "Ring",
    "Travel",
    "block_pair",
    "block_problem",
    "build_pairs",
    "carry_home",
    "circulate",
    "extent",
    "mask_block",
    "masked_out",
    "rows_of",
]

# The strategies that compute one block (a rank's query rows against one k/v
# block): the tiled ones, whose forward returns O and the row statistics and
# whose backward takes the rows' final O and statistics over every key.
BLOCK_STRATEGIES = TILED


@dataclass(frozen=True)
class Ring:
    """What forward and backward share: the comm, the layout, the block strategy, the band
    (``is_causal`` and ``window``), the softcap, the dropout, whether an attn_mask
    is given (its tensors travel as the Function's arguments), and a FlexAttention
    call's score_mod and BlockMask (`attngrad.ring.flex_pairs`; the score_mod's
    captured tensors travel as the Function's arguments); ``masked_out``: the pairs the
    attn_mask keeps no score of (`masked_out`), skipped."""

    comm: RingComm
    layout: str
    is_causal: bool
    strategy: Strategy[Any]
    dropout: Dropout | None = None
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    masked: bool = False
    flex: FlexPairs | None = None
    masked_out: frozenset[tuple[int, int, int, int]] = frozenset()

    @property
    def positional(self) -> bool:
        """Whether blocks need their global origins: dropout hashes global positions, a
        window's band sits at the pair's global offset, a mask's keys are global columns,
        a score_mod and a BlockMask see global positions."""
        return (
            self.dropout is not None or self.window is not None or self.masked
            or self.flex is not None
        )  # fmt: skip

    def steps(self, seq_local: int) -> list[list[Block]]:
        """The blocks of each step s, against the k/v shard of rank r - s."""
        rank, world = self.comm.rank, self.comm.world
        return [
            step_blocks(
                rank,
                (rank - s) % world,
                world,
                self.layout,
                seq_local,
                self.is_causal,
                self.positional,
            )
            for s in range(world)
        ]

    def band(self, blk: Block) -> Band | None:
        """The block's band: the call's causal/window band moved to the pair's global offset
        (query i sees key j when i - left <= j <= i + right in global positions), or the
        block's own causal flag where it has no origin (no window, mask or dropout).  None
        when every row sees every key; a band of dead rows only when the pair sees nothing."""
        r, c = extent(blk.rows), extent(blk.cols)
        if blk.origin is None or not (self.is_causal or self.window is not None):
            return BandSpec.of(None, blk.causal).build(r, c)
        spec = BandSpec.of(self.window, self.is_causal)
        off = blk.origin[0] - blk.origin[1]  # query row i sits at key column i + off
        left = None if spec.left is None else spec.left - off
        right = None if spec.right is None else spec.right + off
        band = Band.of(r, c, left, right)
        return None if band.covers(slice(0, r), slice(0, c)) else band


def extent(s: slice) -> int:
    """The length of a slice with a start and a stop."""
    return int(s.stop - s.start)


def rows_of(t: torch.Tensor, s: slice) -> torch.Tensor:
    """t[:, :, s]: rows (dim 2) of a [B, H, N, ...] tensor; a view."""
    return t[:, :, s]


def mask_block(t: torch.Tensor | None, blk: Block) -> torch.Tensor | None:
    """A [Bm, Hm, nm, Nkm] mask's (or its gradient's) view over the block: its local rows,
    and the columns of its keys' global positions (dims of size 1 stay broadcast)."""
    if t is None:
        return None
    if t.shape[2] > 1:
        t = rows_of(t, blk.rows)
    if t.shape[3] > 1:
        assert blk.origin is not None  # a mask makes the blocks positional
        t = t[..., blk.origin[1] : blk.origin[1] + extent(blk.cols)]
    return t


def block_problem(
    ring: Ring,
    blk: Block,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    skip: bool = True,
    captured: tuple[torch.Tensor, ...] = (),
) -> Problem[Any] | None:
    """The block kernel's problem: the block's rows of q against its k/v block, the block's
    mods (its band, the softcap, the mask's columns, the dropout at its global origin, a
    score_mod and BlockMask at its global origin reading ``captured``) and the strategy's
    tiles for it.  None (with ``skip``) when the band or the BlockMask leaves the pair
    empty: no compute, the k/v block still travels."""
    qb, kb, vb = rows_of(q, blk.rows), rows_of(k, blk.cols), rows_of(v, blk.cols)
    band = ring.band(blk)
    if skip and band is not None and band.key_span(slice(0, qb.shape[2]))[0] >= kb.shape[2]:
        return None
    r, c = qb.shape[2], kb.shape[2]
    if skip and blk.origin is not None and (*blk.origin, r, c) in ring.masked_out:
        return None
    pair = block_pair(ring, blk, qb, kb, vb)
    if skip and pair is not None and pair.empty:
        return None
    dropout = ring.dropout
    if dropout is not None:
        assert blk.origin is not None  # dropout makes the blocks positional
        dropout = dropout.shifted(*blk.origin)
    bias, keep = (mask_block(t, blk) for t in mask)
    if pair is None:
        mods = ScoreMods(bias, keep, band, k.shape[1], r, c, ring.softcap, dropout)
        tiles = ring.strategy.tiles(Shapes.of(qb, kb, vb), q.dtype, None, None)
    else:
        score = pair.score_over(captured)
        mods = ScoreMods(bias, keep, band, k.shape[1], r, c, ring.softcap, dropout, score,
                         pair.blocks)  # fmt: skip
        tiles = pair.tiles
    return Problem(qb, kb, vb, mods, scale, tiles)


def block_pair(
    ring: Ring, blk: Block, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
) -> Pair | None:
    """The block's score_mod and BlockMask (`attngrad.ring.flex_pairs`), or None without."""
    if ring.flex is None:
        return None
    assert blk.origin is not None  # a flex call makes the blocks positional
    return ring.flex.pair(blk.origin, qb, kb, vb)


def masked_out(
    ring: Ring, seq_local: int, mask: tuple[torch.Tensor | None, torch.Tensor | None]
) -> frozenset[tuple[int, int, int, int]]:
    """The pairs of this rank's passes (``seq_local`` rows) in which the attn_mask (bias, keep)
    keeps no score -- keep all False, or bias all -inf -- keyed (q0, k0, rows, keys): their
    blocks contribute nothing to any row, so the ring skips them (`block_problem`).  A bias
    at a finite minimum (``finfo.min``) keeps its scores: such a pair is computed."""
    bias, keep = mask
    found = set()
    for blocks in ring.steps(seq_local):
        for blk in blocks:
            assert blk.origin is not None  # a mask makes the blocks positional
            b, k = mask_block(bias, blk), mask_block(keep, blk)
            if (k is not None and not bool(k.any())) or (
                b is not None and bool(torch.isneginf(b).all())
            ):
                found.add((*blk.origin, extent(blk.rows), extent(blk.cols)))
    return frozenset(found)


def build_pairs(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Build every pair this rank's passes compute (``ring.flex``'s, kept for them), q: [B, Hq,
    n, d] and k: [B, Hkv, n, d], v: [B, Hkv, n, dv] (any rank's shards: the same shapes).
    Called before the autograd.Function runs: a score_mod must be traced where the tensors
    it reads are the caller's -- under ``torch.func.jvp`` or ``grad`` along one of them, a
    wrapper of the transform's level, which inside the Function's forward is not live."""
    for blocks in ring.steps(q.shape[2]):
        for blk in blocks:
            block_pair(ring, blk, rows_of(q, blk.rows), rows_of(k, blk.cols), rows_of(v, blk.cols))


Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Travel:
    """What a ring carries: k, v [B, Hkv, n, .] and, where some rank has them, a direction's
    k' and v' (tangents, or the cotangents of dk and dv; zeros on a rank without one), so
    every rank sends alike.  ``moving``: whether k' and v' travel."""

    tensors: Tensors
    moving: tuple[bool, bool]

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor, k_dir: torch.Tensor | None,
           v_dir: torch.Tensor | None, moving: Sequence[bool]) -> Travel:  # fmt: skip
        """k, v and k_dir, v_dir (None: zero) where ``moving`` (whether some rank has each:
        `attngrad.ring.comm.RingComm.any`) says."""
        tensors: Tensors = (k, v)
        for like, t, moves in ((k, k_dir, moving[0]), (v, v_dir, moving[1])):
            if moves:
                tensors += (torch.zeros_like(like) if t is None else t.contiguous(),)
        return Travel(tensors, (bool(moving[0]), bool(moving[1])))

    def heads(self, kh: slice) -> Travel:
        """The kv heads ``kh`` (contiguous: they travel)."""
        return Travel(tuple(t[:, kh].contiguous() for t in self.tensors), self.moving)

    def directions(self, shards: Tensors) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k', v') among ``shards`` (what arrived in place of `tensors`), None where not
        travelling."""
        k_dir = shards[2] if self.moving[0] else None
        v_dir = shards[2 + self.moving[0]] if self.moving[1] else None
        return k_dir, v_dir


def circulate(
    ring: Ring, seq_local: int, held: Tensors, visit: Callable[[list[Block], Tensors], None]
) -> None:
    """Pass ``held`` (this rank's shards, the same shapes on every rank) around the ring:
    at step s the shards of rank r - s are in hand, ``visit(blocks, shards)`` computes
    that step's pairs while the next ones arrive."""
    steps = ring.steps(seq_local)
    for s, blocks in enumerate(steps):
        incoming = ring.comm.send_recv(held) if s + 1 < len(steps) else None
        visit(blocks, held)
        if incoming is not None:
            held = tuple(incoming.wait())


def carry_home(
    ring: Ring,
    seq_local: int,
    held: Tensors,
    likes: Tensors,
    visit: Callable[[list[Block], Tensors, Tensors], None],
    own_first: bool,
) -> Tensors:
    """Pass ``held`` around the ring with accumulators shaped like ``likes`` (in the compute
    dtype) travelling beside them; returns this rank's, holding every rank's share.

    At step s = 1 .. P-1 the shards of rank r - s arrive (and go on to r + 1 while
    this rank computes); their accumulators arrive from rank r - 1 holding the shares
    of ranks r - s + 1 .. r - 1 (zeros at s = 1), ``visit(blocks, shards,
    accumulators)`` adds this rank's share into them, and they go on.  After step P-1
    the own shards' accumulators come back holding every other rank's share, and the
    own share joins them: P - 1 sends of the shards and P - 1 of the accumulators per
    rank.  With ``own_first`` the own pairs go first, into accumulators of their own,
    while the first shards travel: that wait is hidden, for one more set of
    accumulators held (the callers take it where the accumulators are a head group's).
    """
    steps = ring.steps(seq_local)

    def zeros() -> Tensors:
        return tuple(torch.zeros(t.shape, dtype=compute_dtype(t.dtype), device=t.device)
                     for t in likes)  # fmt: skip

    incoming: Exchange | None = ring.comm.send_recv(held)
    own_share = zeros() if own_first else ()
    if own_first:
        visit(steps[0], held, own_share)
    travelling: Exchange | None = None  # the accumulators of the shards about to arrive
    for s in range(1, len(steps)):
        assert incoming is not None  # posted at the step before
        shards = tuple(incoming.wait())
        incoming = ring.comm.send_recv(shards) if s + 1 < len(steps) else None
        accumulators = zeros() if travelling is None else tuple(travelling.wait())
        visit(steps[s], shards, accumulators)
        del shards
        travelling = ring.comm.send_recv(accumulators) if accumulators else None
        del accumulators
    own = () if travelling is None else tuple(travelling.wait())  # () where no accumulators
    if not own_first:
        visit(steps[0], held, own)
    for total, share in zip(own, own_share, strict=False):
        total += share
    return own
