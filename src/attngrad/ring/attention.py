r"""Ring attention: the k/v shards travel around the ranks, each rank keeps its queries.

Rank r holds q, k, v of its shard (N/P positions).  At step s = 0..P-1 it
holds the k/v shard of rank r - s (mod P), computes its queries against it
with the block kernel (flash's tiled forward by default) while sending that
shard on to rank r + 1 and receiving the next from rank r - 1, and merges the
partial result through its row statistics (m, log l) (see `attngrad.core.ops`):

    m = max(m_a, m_b)    w_a = l_a exp(m_a - m)    w_b = l_b exp(m_b - m)
    l = w_a + w_b        O = (O_a w_a + O_b w_b) / l     (weights / l <= 1: no overflow)

A partial whose rows attend nothing has l = 0 and weight 0; when both do,
the row stays O = 0, l = 0 (never NaN).

Backward needs, for each block, only P = exp((S - m) - log l) with the
*final* statistics, and Delta = rowsum(dO * O) with the *final* O:

    dV_blk = P^T dO    dS = P * (dO v_blk^T - Delta + dlse)    dq += s dS k_blk    dK_blk = s dS^T q

so the block kernel's backward runs unchanged on each (q shard, k/v block)
pair.  k/v travel the ring again, and each block's dK/dV travel with it,
collecting every rank's contribution, until they reach their owner.  Each
rank saves only its own q, k, v, O and statistics: O(N/P) memory per rank.

Dropout and sinks come out as in single-process `attngrad.attention`:

* dropout's mask Z is a hash of (seed, offset, b * Hq + h, global query
  position, global key position) (`attngrad.core.dropout`).  Every rank draws
  (seed, offset) from its generator, as `attention` does, and all take rank
  0's draw (one broadcast); each block's mask is shifted to the block's
  global origin (`attngrad.ring.layout`), so the block kernel draws exactly
  the bits of the gathered call.  The merge above is linear in the partial
  outputs, and (m, l) are those of the undropped softmax, so forward and
  backward need nothing else.  Backward then runs as one head group: Z
  hashes the call's head index, which a group's slice of the heads would
  renumber.
* a sink joins each row's denominator once, so it is merged after the ring,
  into the final (O, lse) (`attngrad.core.sinks.merge_sinks`), and its gradient
  comes from autograd through that merge: dlse reaches the ring's backward.

The keywords that act on scores are the block kernel's own, per block:

* ``window``: the band i - left <= j <= i + right in *global* positions
  becomes, for a block whose first row and key sit at global (q0, k0), the
  block's band shifted by q0 - k0 (`_Ring.band`); a pair the band leaves
  empty is skipped (no compute; its k/v shard still travels).
* ``softcap``: the block kernel's score modification, unchanged.
* ``attn_mask`` [Bm, Hm, N/P, N]: rows cut like q, keys the whole sequence in
  true order; a block takes its rows and the columns of its keys' global
  positions (views), and its bias gradient goes into the same columns of
  dmask: the mask never travels.

Window, mask and dropout need each block's global origin, so their blocks
merge only where they stay contiguous in the sequence (`step_blocks`'s
``positional``).

Forward mode (`ring_tangent`): with the final statistics, P_b = exp(S_b - lse)
of every block is the softmax over all keys, so each block's forward-mode
pass gives (acc_b - mu_b O, mu_b), acc_b = (P_b * S'_b) v_b + P_b v'_b and
mu_b = rowsum(P_b * S'_b), linear in the blocks' shares: their sums over a
ring that carries k' and v' with k and v are (O', lse').

Double backward (`ring_differentiable`): under ``create_graph=True``,
`RingAttention`'s backward takes the gradients of the same forward built from
differentiable pieces -- a rotation whose backward carries gradients home
around the ring (`attngrad.ring.comm.RingShift`), each pair through the block
kernel's `AttentionFunction` (itself differentiable twice), a merge by lse
in tensor ops -- with create_graph, so autograd differentiates them again.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from attngrad.api import attention
from attngrad.autograd.tangent import output_tangent
from attngrad.core.band import Band, BandSpec, validate_window
from attngrad.core.contract import (
    ArgumentTypeError,
    Shapes,
    check_flag,
    validate_attention,
)
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Backward, Problem, Strategy
from attngrad.core.keywords import validate_generator, validate_sinks, validate_softcap
from attngrad.core.ops import compute_dtype, log_normalizer, lse
from attngrad.core.scores import ScoreMods
from attngrad.core.sinks import merge_sinks
from attngrad.ring.all_to_all import Keywords, all_to_all_attention
from attngrad.ring.checks import (
    Settings,
    check_same_shards,
    shard_mask,
    tensor_kind,
    validate_ring,
    validate_scheme,
)
from attngrad.ring.comm import DEFAULT_TIMEOUT, Exchange, RingComm, RingShift, shared_dropout
from attngrad.ring.flex_pairs import FlexPairs, Pair
from attngrad.ring.layout import Block, chunks_of, step_blocks
from attngrad.strategies import REGISTRY, STRATEGIES, TILED, tiled_default, unavailable_reason
from attngrad.strategies.base import differentiable

__all__ = ["BLOCK_STRATEGIES", "merge_partial_", "ring_attention"]

_NEG_INF = float("-inf")


# -- the block kernel ---------------------------------------------------------

# The strategies that compute one block (a rank's query rows against one k/v
# block): the tiled ones, whose forward returns O and the row statistics and
# whose backward takes the rows' final O and statistics over every key.
BLOCK_STRATEGIES = TILED


# -- forward: partial outputs merged through their stats --------------------------


def _max_and_sum(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, l) from stats [..., r, 2]: m = -inf and l = 0 on a row that attends nothing."""
    m, log_l = stats.unbind(-1)
    dead = log_l == float("inf")
    return m.masked_fill(dead, _NEG_INF), torch.exp(log_l).masked_fill(dead, 0.0)


def merge_partial_(
    o: torch.Tensor, stats: torch.Tensor, o_b: torch.Tensor, stats_b: torch.Tensor
) -> None:
    """Merge the partial (o_b, stats_b) into (o, stats) in place (see the module docstring).

    o, o_b: [..., r, dv]; stats, stats_b: [..., r, 2].  o and stats are updated.
    """
    (m_a, l_a), (m_b, l_b) = _max_and_sum(stats), _max_and_sum(stats_b)
    m = torch.maximum(m_a, m_b)
    shift = m.masked_fill(m == _NEG_INF, 0.0)  # both parts dead: weights exp(-inf) = 0
    w_a, w_b = l_a * torch.exp(m_a - shift), l_b * torch.exp(m_b - shift)
    l_sum = w_a + w_b
    total = l_sum.masked_fill(l_sum == 0, 1.0)
    o.mul_((w_a / total).unsqueeze(-1)).addcmul_(o_b, (w_b / total).unsqueeze(-1))
    # a part of weight 0 leaves the other's statistics as they were, bit for bit
    log_a, log_b = (st[..., 1] + (st[..., 0] - shift) for st in (stats, stats_b))
    log_l = torch.where(w_b == 0, log_a, torch.where(w_a == 0, log_b, log_normalizer(l_sum)))
    stats.copy_(torch.stack((shift, log_l), dim=-1))


@dataclass(frozen=True)
class _Ring:
    """What forward and backward share: the comm, the layout, the block strategy, the band
    (``is_causal`` and ``window``), the softcap, the dropout, whether an attn_mask
    is given (its tensors travel as the Function's arguments), and a FlexAttention
    call's score_mod and BlockMask (`attngrad.ring.flex_pairs`; the score_mod's
    captured tensors travel as the Function's arguments)."""

    comm: RingComm
    layout: str
    is_causal: bool
    strategy: Strategy[Any]
    dropout: Dropout | None = None
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    masked: bool = False
    flex: FlexPairs | None = None

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

    def pairs(self, seq_local: int) -> list[list[Block]]:
        """Every (query chunk, key chunk) pair of each step as its own block, none skipped
        and none merged: the same blocks on every rank (the second-order path's, whose
        backward the autograd engine orders by the graph: it must be one graph everywhere)."""
        rank, world = self.comm.rank, self.comm.world
        mine = chunks_of(rank, world, self.layout)
        m = seq_local // len(mine)
        steps = []
        for s in range(world):
            theirs = chunks_of((rank - s) % world, world, self.layout)
            steps.append(
                [
                    Block(
                        slice(i * m, (i + 1) * m),
                        slice(j * m, (j + 1) * m),
                        False,
                        (cq * m, ck * m),
                    )
                    for i, cq in enumerate(mine)
                    for j, ck in enumerate(theirs)
                ]
            )
        return steps

    def band(self, blk: Block) -> Band | None:
        """The block's band: the call's causal/window band moved to the pair's global offset
        (query i sees key j when i - left <= j <= i + right in global positions), or the
        block's own causal flag where it has no origin (no window, mask or dropout).  None
        when every row sees every key; a band of dead rows only when the pair sees nothing."""
        r, c = _extent(blk.rows), _extent(blk.cols)
        if blk.origin is None or not (self.is_causal or self.window is not None):
            return BandSpec.of(None, blk.causal).build(r, c)
        spec = BandSpec.of(self.window, self.is_causal)
        off = blk.origin[0] - blk.origin[1]  # query row i sits at key column i + off
        left = None if spec.left is None else spec.left - off
        right = None if spec.right is None else spec.right + off
        band = Band.of(r, c, left, right)
        return None if band.covers(slice(0, r), slice(0, c)) else band


def _extent(s: slice) -> int:
    return int(s.stop - s.start)


def _rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    """t[:, :, s]: rows (dim 2) of a [B, H, N, ...] tensor; a view."""
    return t[:, :, s]


def _mask_block(t: torch.Tensor | None, blk: Block) -> torch.Tensor | None:
    """A [Bm, Hm, nm, Nkm] mask's (or its gradient's) view over the block: its local rows,
    and the columns of its keys' global positions (dims of size 1 stay broadcast)."""
    if t is None:
        return None
    if t.shape[2] > 1:
        t = _rows(t, blk.rows)
    if t.shape[3] > 1:
        assert blk.origin is not None  # a mask makes the blocks positional
        t = t[..., blk.origin[1] : blk.origin[1] + _extent(blk.cols)]
    return t


def _problem(
    ring: _Ring,
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
    qb, kb, vb = _rows(q, blk.rows), _rows(k, blk.cols), _rows(v, blk.cols)
    band = ring.band(blk)
    if skip and band is not None and band.key_span(slice(0, qb.shape[2]))[0] >= kb.shape[2]:
        return None
    pair = _pair(ring, blk, qb, kb, vb)
    if skip and pair is not None and pair.empty:
        return None
    dropout = ring.dropout
    if dropout is not None:
        assert blk.origin is not None  # dropout makes the blocks positional
        dropout = dropout.shifted(*blk.origin)
    bias, keep = (_mask_block(t, blk) for t in mask)
    r, c = qb.shape[2], kb.shape[2]
    if pair is None:
        mods = ScoreMods(bias, keep, band, k.shape[1], r, c, ring.softcap, dropout)
        tiles = ring.strategy.tiles(Shapes.of(qb, kb, vb), q.dtype, None, None)
    else:
        score = pair.score_over(captured)
        mods = ScoreMods(bias, keep, band, k.shape[1], r, c, ring.softcap, dropout, score,
                         pair.blocks)  # fmt: skip
        tiles = pair.tiles
    return Problem(qb, kb, vb, mods, scale, tiles)


def _pair(
    ring: _Ring, blk: Block, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
) -> Pair | None:
    """The block's score_mod and BlockMask (`attngrad.ring.flex_pairs`), or None without."""
    if ring.flex is None:
        return None
    assert blk.origin is not None  # a flex call makes the blocks positional
    return ring.flex.pair(blk.origin, qb, kb, vb)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: _Ring,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, n, dv] (input dtype) and stats: [B, Hq, n, 2] of this rank's queries over all keys.

    q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv], contiguous; n = N / P.
    mask: (bias, keep), each [Bm, Hm, nm, Nkm] (nm 1 or n, Nkm 1 or N) or None.
    captured: the score_mod's tensors (``ring.flex``), in `FlexPairs.keys`'s order.
    """
    b, hq, n, _ = q.shape
    dtype = compute_dtype(q.dtype)
    shape = torch.Size((b, hq, n, v.shape[-1]))
    o: torch.Tensor | None = None
    stats = torch.zeros((b, hq, n, 2), dtype=dtype, device=q.device)
    stats[..., 1] = float("inf")  # no key seen yet: l = 0
    steps = ring.steps(n)
    kc, vc = k, v
    for s, blocks in enumerate(steps):
        incoming = ring.comm.send_recv((kc, vc)) if s + 1 < len(steps) else None
        for blk in blocks:
            problem = _problem(ring, blk, q, kc, vc, scale, mask, captured=captured)
            if problem is None:
                continue
            o_b, saved = ring.strategy.forward(problem)
            stats_b = saved["stats"]
            if o is None and o_b.shape == shape:  # a first partial over every row: O itself
                o, stats = o_b.to(dtype), stats_b
            else:
                o = o if o is not None else torch.zeros(shape, dtype=dtype, device=q.device)
                merge_partial_(_rows(o, blk.rows), _rows(stats, blk.rows), o_b, stats_b)
        if incoming is not None:
            kc, vc = incoming.wait()
    if o is None:  # every pair empty (a window that reaches no key of this rank's rows)
        o = torch.zeros(shape, dtype=dtype, device=q.device)
    return o.to(q.dtype), stats


# -- backward: dK/dV travel with their k/v block ---------------------------------


# Backward runs one ring per group of kv heads (at most this many groups): the
# buffers a rank holds for the ring (a remote k/v shard, its dK/dV accumulators)
# then cover only that group's heads, while the outputs stay whole.  With
# dropout or a mask one group: dropout's mask hashes each head's index among
# all Hq, and a mask's heads need not follow the kv heads'.
HEAD_GROUPS = 4


@dataclass(frozen=True)
class _Shard:
    """This rank's tensors of one backward, shapes as in `ring_forward`: q, k, v, the
    final O and stats of its rows, dout [B, Hq, n, dv] and dlse [B, Hq, n], lse's
    cotangent (None: lse unused); the mask's (bias, keep) and dbias, the bias's
    gradient accumulator (None: not wanted); the score_mod's captured tensors and their
    gradients' accumulators (None each where not wanted), in `FlexPairs.keys`'s order."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    stats: torch.Tensor
    dout: torch.Tensor
    dlse: torch.Tensor | None
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    dbias: torch.Tensor | None = None
    captured: tuple[torch.Tensor, ...] = ()
    dcaptured: tuple[torch.Tensor | None, ...] = ()

    def heads(self, qh: slice, kh: slice) -> _Shard:
        """The query heads ``qh`` and their kv heads ``kh`` (k, v made contiguous: they travel)."""
        assert self.mask == (None, None) and not self.captured  # these run as one group
        return _Shard(
            self.q[:, qh], self.k[:, kh].contiguous(), self.v[:, kh].contiguous(), self.o[:, qh],
            self.stats[:, qh], self.dout[:, qh], None if self.dlse is None else self.dlse[:, qh],
        )  # fmt: skip


def ring_backward(
    shard: _Shard, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shard (input dtype); the bias's gradient added into
    ``shard.dbias``.

    The kv heads are cut into up to `HEAD_GROUPS` groups (a GQA group's query
    heads go with their kv head) and each group's gradients come from a ring
    pass of their own, `_ring_backward_group`: same messages in total, each
    1/HEAD_GROUPS the size, so the ring's buffers shrink by that factor.
    With dropout, a mask or a flex call, one group of all heads (module docstring; a
    score_mod or mask_mod reads the head index, which a group would renumber).
    """
    q, k = shard.q, shard.k
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
    one = ring.dropout is not None or shard.mask != (None, None) or ring.flex is not None
    groups = 1 if one else min(hkv, HEAD_GROUPS)
    if groups == 1:  # the accumulators that come home are dk, dv: no second pair held
        dk_c, dv_c = _ring_backward_group(dq, shard, ring, scale)
        return dq.to(q.dtype), dk_c.to(k.dtype), dv_c.to(shard.v.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(shard.v)
    bounds = [hkv * i // groups for i in range(groups + 1)]
    for h0, h1 in itertools.pairwise(bounds):
        qh, kh = slice(h0 * g, h1 * g), slice(h0, h1)
        dk[:, kh], dv[:, kh] = _ring_backward_group(dq[:, qh], shard.heads(qh, kh), ring, scale)
    return dq.to(q.dtype), dk, dv


def _ring_backward_group(
    dq: torch.Tensor, shard: _Shard, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring pass for a group of heads: adds into ``dq`` (and the shard's dbias), returns
    this shard's dk, dv.

    The k/v shards travel the ring again.  At step s = 1 .. P-1 the shard of
    rank r - s arrives (and goes on to r + 1 while this rank computes); its
    dK/dV accumulators arrive from rank r - 1 holding the shares of ranks
    r - s + 1 .. r - 1 (zeros at s = 1), this rank adds its share into them
    and passes them on.  After step P-1 the own shard's accumulators come
    back holding every other rank's share, and the own block's share goes
    into them last: P - 1 sends of k/v and P - 1 of dK/dV per rank, and no
    rank keeps a second set of dK/dV buffers while the others travel.
    dk, dv come back in the compute dtype.
    """
    q, k, v, o, stats, dout, dlse = (
        shard.q,
        shard.k,
        shard.v,
        shard.o,
        shard.stats,
        shard.dout,
        shard.dlse,
    )
    dtype = compute_dtype(q.dtype)
    steps = ring.steps(q.shape[2])

    def add_share(blocks: list[Block], kc: torch.Tensor, vc: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor) -> None:  # fmt: skip
        for blk in blocks:
            problem = _problem(ring, blk, q, kc, vc, scale, shard.mask, captured=shard.captured)
            if problem is None:
                continue
            dbias = _mask_block(shard.dbias, blk)
            grads = (_rows(dq, blk.rows), _rows(dk, blk.cols), _rows(dv, blk.cols), dbias)
            final = {"o": _rows(o, blk.rows), "stats": _rows(stats, blk.rows)}
            dlse_b = None if dlse is None else _rows(dlse, blk.rows)
            pair = _pair(ring, blk, problem.q, problem.k, problem.v)
            dcaptured = () if pair is None else pair.pick(shard.dcaptured)
            ring.strategy.backward_into(
                Backward(problem, final, _rows(dout, blk.rows), dlse_b, grads, dcaptured)
            )

    incoming: Exchange | None = ring.comm.send_recv((k, v))
    travelling: Exchange | None = None  # the accumulators of the shard about to arrive
    for s in range(1, len(steps)):
        assert incoming is not None  # posted at the step before
        kc, vc = incoming.wait()
        incoming = ring.comm.send_recv((kc, vc)) if s + 1 < len(steps) else None
        if travelling is None:
            dk = torch.zeros(kc.shape, dtype=dtype, device=q.device)
            dv = torch.zeros(vc.shape, dtype=dtype, device=q.device)
        else:
            dk, dv = travelling.wait()
        add_share(steps[s], kc, vc, dk, dv)
        del kc, vc
        travelling = ring.comm.send_recv((dk, dv))
        del dk, dv
    assert travelling is not None  # P >= 2: at least one remote step
    dk_own, dv_own = travelling.wait()
    del travelling
    add_share(steps[0], k, v, dk_own, dv_own)
    return dk_own, dv_own


# -- forward mode: the tangents of O and lse, one more ring ------------------------


def ring_tangent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    stats: torch.Tensor,
    tangents: tuple[torch.Tensor | None, ...],
    ring: _Ring,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O' [B, Hq, n, dv] in the input dtype, lse' [B, Hq, n] in the compute dtype) of this
    rank's rows, along tangents (q', k', v', bias', *captured') (None: zero), shapes as
    their inputs (captured: the score_mod's tensors, as in `ring_forward`).

    With the final statistics known, each block's P = exp(S - lse) is already the
    softmax over every key (`attngrad.autograd.tangent`), so the block kernel's
    forward mode run on the block against the final O and stats returns
    (acc_b - mu_b O, mu_b), acc_b = (P * S') v + P v' and mu_b = rowsum(P * S') its
    keys' shares; both are linear in the shares, so their sum over blocks is
    (O', lse').  k' and v' travel with k and v (zeros where absent, so every rank
    sends alike): one ring of P - 1 steps, O(N/P) memory.
    """
    t_q, t_k, t_v, t_bias, *t_captured = tangents
    dtype = compute_dtype(q.dtype)
    t_k = torch.zeros_like(k) if t_k is None else t_k.contiguous()
    t_v = torch.zeros_like(v) if t_v is None else t_v.contiguous()
    t_o = torch.zeros(o.shape, dtype=dtype, device=q.device)
    t_lse = torch.zeros(stats.shape[:-1], dtype=dtype, device=q.device)
    steps = ring.steps(q.shape[2])
    held: tuple[torch.Tensor, ...] = (k, v, t_k, t_v)
    for s, blocks in enumerate(steps):
        incoming = ring.comm.send_recv(held) if s + 1 < len(steps) else None
        kc, vc, tkc, tvc = held
        for blk in blocks:
            problem = _problem(ring, blk, q, kc, vc, scale, mask, captured=captured)
            if problem is None:
                continue
            final = {"o": _rows(o, blk.rows), "stats": _rows(stats, blk.rows)}
            pair = _pair(ring, blk, problem.q, problem.k, problem.v)
            moved = (
                None if t_q is None else _rows(t_q, blk.rows),
                _rows(tkc, blk.cols),
                _rows(tvc, blk.cols),
                _mask_block(t_bias, blk),
                *(() if pair is None else pair.pick(tuple(t_captured))),
            )
            do_b, dlse_b = output_tangent(ring.strategy, problem, final, moved, final["o"])
            _rows(t_o, blk.rows).add_(do_b)
            _rows(t_lse, blk.rows).add_(dlse_b)
        if incoming is not None:
            held = tuple(incoming.wait())
    return t_o.to(q.dtype), t_lse


# -- second order: the forward again, as a differentiable composition ------------------


def ring_differentiable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: _Ring,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hq, n, dv] in the input dtype, lse [B, Hq, n]) as `ring_forward` computes them,
    recorded by autograd to every order: the other ranks' k/v gathered by `RingShift`
    (whose backward carries their gradients home around the ring), each (query chunk,
    key chunk) pair through the block kernel's `AttentionFunction` (double backward and
    forward mode of their own), the partials merged through their lse in tensor ops.

    It holds every rank's k/v (O(N) per rank) and, for backward, each pair's O and
    statistics: the memory of the second-order path (the first-order one is O(N/P)).
    Every pair is computed, also those the band or the BlockMask leaves empty (the
    kernel skips their tiles), so that the graph, and with it the order of the rotations' backward
    messages, is one on every rank.
    """
    dtype = compute_dtype(q.dtype)
    copies = RingShift.apply(ring.comm, k, v)  # type: ignore[no-untyped-call]
    held = [(k, v), *zip(copies[0::2], copies[1::2], strict=True)]
    per_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for (kc, vc), blocks in zip(held, ring.pairs(q.shape[2]), strict=True):
        for blk in blocks:
            problem = _problem(ring, blk, q, kc, vc, scale, mask, skip=False, captured=captured)
            assert problem is not None
            o_b, lse_b, _ = differentiable(ring.strategy, problem)
            per_rows.setdefault(blk.rows.start, []).append((o_b, lse_b))
    outs, lses = [], []
    for start in sorted(per_rows):
        o_r, lse_r = _merge_by_lse(per_rows[start], dtype)
        outs.append(o_r)
        lses.append(lse_r)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _merge_by_lse(
    parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials (O_b [B, H, r, dv], lse_b [B, H, r]) merged: lse = log sum_b exp(lse_b),
    O = sum_b exp(lse_b - lse) O_b; smooth to every order where a part, or the whole row,
    attends nothing (lse_b = -inf: weight 0; a dead row: O = 0, lse = -inf)."""
    lse_s = torch.stack([p[1].to(dtype) for p in parts])  # (K, B, H, r)
    top = lse_s.max(dim=0).values.detach()
    top = top.masked_fill(top == float("-inf"), 0.0)
    w = torch.exp(lse_s - top)
    total = w.sum(dim=0)
    live = total > 0
    safe = torch.where(live, total, torch.ones_like(total))
    lse_ = torch.where(live, top + torch.log(safe), float("-inf"))
    o = sum(p[0].to(dtype) * (w_b / safe).unsqueeze(-1) for p, w_b in zip(parts, w, strict=True))
    assert isinstance(o, torch.Tensor)
    return o, lse_


class RingAttention(torch.autograd.Function):
    """autograd.Function over this rank's q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv],
    the mask's (bias, keep) [Bm, Hm, nm, Nkm] (or None) and a score_mod's captured tensors.

    RingAttention.apply(q, k, v, bias, keep, ring, scale, *captured) -> (O, lse, stats),
    stats non-differentiable (returned so that torch.func may save it).  Backward: the
    first-order ring (`ring_backward`, O(N/P)); under ``create_graph=True`` the
    gradients of `ring_differentiable` instead, which autograd differentiates again.
    jvp: `ring_tangent`.  A captured tensor's gradient is this rank's share (its rows'
    scores'): the caller sums it over the ranks.
    """

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        ring: _Ring,
        scale: float,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o, stats = ring_forward(q, k, v, ring, scale, (bias, keep), captured)
        return o, lse(stats), stats

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, keep, ring, scale, *captured = inputs
        o, _, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, bias, keep, o, stats, *captured)
        ctx.save_for_forward(q, k, v, bias, keep, o, stats, *captured)
        ctx.ring, ctx.scale = ring, scale
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, _: object
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, bias, keep, o, stats, *captured = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        if torch.is_grad_enabled():  # create_graph=True: the gradients will be differentiated
            dq, dk, dv, dbias, *dcap_graph = _differentiable_gradients(ctx, dout, dlse)
            return dq, dk, dv, dbias, None, None, None, *dcap_graph
        if dout is None:
            dout = torch.zeros_like(o)
        need_bias = bias is not None and ctx.needs_input_grad[3]
        dbias = None
        if need_bias:
            dbias = torch.zeros(bias.shape, dtype=compute_dtype(q.dtype), device=q.device)
        dcaptured = tuple(
            torch.zeros(t.shape, dtype=compute_dtype(t.dtype), device=t.device)
            if ctx.needs_input_grad[7 + i] else None
            for i, t in enumerate(captured)
        )  # fmt: skip
        shard = _Shard(q, k, v, o, stats, dout, dlse, (bias, keep), dbias, tuple(captured),
                       dcaptured)  # fmt: skip
        dq, dk, dv = ring_backward(shard, ring, scale)
        dbias_out = None if dbias is None else dbias.to(bias.dtype)
        dcap = (None if g is None else g.to(t.dtype) for g, t in zip(dcaptured, captured,
                                                                     strict=True))  # fmt: skip
        return dq, dk, dv, dbias_out, None, None, None, *dcap

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, bias, keep, o, stats, *captured = ctx.saved_tensors
        moved = (*tangents[:4], *tangents[7:])
        t_o, t_lse = ring_tangent(
            q, k, v, o, stats, moved, ctx.ring, ctx.scale, (bias, keep), tuple(captured)
        )
        return t_o, t_lse, None


def _differentiable_gradients(
    ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias, *dcaptured) of `RingAttention` as a graph autograd can
    differentiate again: the gradients of `ring_differentiable` over the saved inputs,
    with create_graph."""
    q, k, v, bias, keep, _, _, *captured = ctx.saved_tensors
    inputs = [q, k, v, bias, *captured]
    needs = [*ctx.needs_input_grad[:4], *ctx.needs_input_grad[7:]]
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    o2, lse2 = ring_differentiable(q, k, v, ctx.ring, ctx.scale, (bias, keep), tuple(captured))
    outs, cots = [], []
    for out, cot in ((o2, dout), (lse2, dlse)):
        if cot is not None:
            outs.append(out)
            # a dead row's lse is -inf: its cotangent reaches no key (and must not make NaN)
            cots.append(cot if out is o2 else torch.where(lse2.isfinite(), cot, 0.0))
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    if outs and wanted:
        found = torch.autograd.grad(
            outs, [inputs[i] for i in wanted], cots, create_graph=True, allow_unused=True
        )
        for i, g in zip(wanted, found, strict=True):
            grads[i] = g
    return tuple(grads)


def flex_over_ring(
    comm: RingComm,
    layout: str,
    strategy: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pairs: FlexPairs,
    captured: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hq, n, dv], lse [B, Hq, n]) of `attngrad.ring.flex_ring_attention`'s scheme="ring":
    this rank's q: [B, Hq, n, d] against every rank's k: [B, Hkv, n, d], v: [B, Hkv, n, dv]
    around the ring, each pair with ``pairs``' score_mod and BlockMask (skipped where it
    leaves the pair empty); ``captured``: the score_mod's tensors, in ``pairs.keys``'s
    order (their gradients are this rank's shares).  Checked by the caller."""
    ring = _Ring(comm, layout, False, REGISTRY[strategy], flex=pairs)
    o, lse_, _ = RingAttention.apply(q, k.contiguous(), v.contiguous(), None, None, ring, scale,
                                     *captured)  # type: ignore[no-untyped-call]  # fmt: skip
    return o, lse_


# -- the public call ----------------------------------------------------------------


def _ring_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` (None: the default one), or None when there is no ring to run over:
    no initialised process group, or a group of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    timeout: float = DEFAULT_TIMEOUT,
    strategy: str | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    sinks: torch.Tensor | None = None,
    scheme: str = "ring",
    attn_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention over a sequence sharded across the ranks of ``group``; each rank passes its shard.

    q: [..., Hq, N/P, d], k: [..., Hkv, N/P, d], v: [..., Hkv, N/P, dv] -> [..., Hq, N/P, dv],
    this rank's shard of the output of ``attention(Q, K, V, is_causal=...,
    scale=..., enable_gqa=True)`` over the full sequence (Hq a multiple of Hkv;
    k and v are never expanded).  ``layout`` says which positions the shard
    holds (`attngrad.ring.shard` cuts them): ``"contiguous"`` (rank r: chunk r
    of P) or ``"zigzag"`` (rank r: chunks r and 2P-1-r of 2P, which balances
    ``is_causal`` work).  ``group``: the process group (None: the default
    one); without an initialised process group, or with one rank, this is
    plain `attngrad.attention`.

    ``scheme``: how the ranks share the work.  ``"ring"`` (the default): each
    rank keeps its queries and the k/v shards travel around the ranks
    (`attngrad.ring.attention`), with every keyword below but no
    ``strategy`` beyond the tiled ones.  ``"all_to_all"`` (DeepSpeed-Ulysses): an
    all-to-all trades the sequence shards for whole sequences of H/P heads
    per rank, plain `attngrad.attention` runs on them with any strategy
    (``strategy``, default "auto") and every keyword, and a second all-to-all
    trades the output back (`attngrad.ring.all_to_all`); Hq and Hkv must
    divide by P; it also takes every strategy and ``torch.func.vmap``.

    Derivatives, under both schemes: backward; double backward
    (``create_graph=True``, e.g. a gradient penalty); forward mode
    (``torch.autograd.forward_ad`` and ``torch.func.jvp``: each rank passes
    its shards' tangents and gets its rows' tangents of out and lse).  Under
    "ring" first-order backward and forward mode are rings of their own at
    O(N/P) memory per rank (forward mode sends k' and v' beside k and v);
    under ``create_graph=True`` the backward recomputes the forward as a
    differentiable composition -- the other ranks' k/v gathered by a
    differentiable rotation, each (query chunk, key chunk) pair through the
    block kernel's own autograd Function, merged by lse -- whose gradients
    autograd differentiates again: that path holds every rank's k/v and each
    pair's partial output, O(N) per rank.  Every rank must take the same
    derivatives (``create_graph`` alike).  Third derivatives raise.

    ``attn_mask``: bool (True = attend) or float (added to the scores, its
    gradient returned), the rows of this rank's shard against every key:
    broadcastable to [..., Hq, N/P, N], keys in the sequence's true order --
    ``shard(mask, rank, P, layout)`` of the full [..., N, N] mask; its
    gradient is this rank's rows'.  Not with ``is_causal`` (as in
    `attngrad.attention`; ``window=(None, 0)`` is causal and takes a mask).
    ``window=(left, right)``: query i attends keys i - left .. i + right in
    global positions; under "ring" each (query chunk, key chunk) pair takes
    the band at the pair's global offset, and pairs it leaves empty are
    skipped (the k/v shard still travels).  ``softcap``: scores capped to
    c tanh(S / c) before the mask, as in `attngrad.attention`.

    ``timeout``: seconds a rank waits on its peers at each step before it
    raises `attngrad.ring.RingTimeoutError` (a peer died, hangs or never
    called).  ``strategy``: under "ring" the per-block kernel, one of
    `BLOCK_STRATEGIES` (None: triton on CUDA when Triton is installed, else
    flash); under "all_to_all" any of `attngrad.STRATEGIES` or "auto".
    ``return_lse=True`` returns ``(out, lse)`` as `attngrad.attention` does:
    lse [..., Hq, N/P], this shard's rows' log-sum-exp over the full sequence.

    ``dropout_p``, ``generator``: attention dropout as in `attngrad.attention`,
    with the mask of the gathered call: every rank draws (seed, offset) from
    ``generator`` (None: its device's default generator), which advances it
    as `attention`'s draw would, and all ranks use rank 0's draw (one
    broadcast).  So under ``torch.manual_seed(s)`` (or a generator seeded s)
    the result is this rank's shard of ``attention(Q, K, V, dropout_p=p,
    ...)`` under the same seed, however the other ranks are seeded.

    ``sinks``: as in `attngrad.attention`, [Hq] (one logit per head) or
    broadcastable to [..., Hq, N/P] (per token: this rank's rows; cut a
    [..., Hq, N] one with ``shard(s.unsqueeze(-1), rank, P, layout).squeeze(-1)``).
    The gradient a rank gets for a per-head (or any row-shared) ``sinks`` is
    its own share: for a sink parameter shared by the ranks, sum its ``.grad``
    over ``group`` (``dist.all_reduce``), as for any parameter replicated
    across them; a per-token one's is its rows'.  The same holds for an
    ``attn_mask`` shared by the rows.

    Shards of unequal length, or different shapes, dtypes or settings on
    different ranks, raise ValueError on every rank (checked with one small
    all_gather).  Backward is collective too: every rank that called forward
    must run it.
    """
    scheme = validate_scheme(scheme)
    shapes = validate_attention(q, k, v, None, dropout_p, is_causal, scale, True)
    check_flag("return_lse", return_lse)
    sink = validate_sinks(sinks, q, shapes)
    generator = validate_generator(generator, q.device)
    window = validate_window(window)
    softcap = validate_softcap(softcap)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), "
            f"got {type(group).__name__}; make one with dist.new_group(ranks)."
        )
    if scheme == "all_to_all":
        strategy = "auto" if strategy is None else strategy
        validate_ring(
            shapes,
            layout,
            timeout,
            strategy,
            ("auto", *STRATEGIES),
            "local call (scheme='all_to_all')",
        )
    else:
        if strategy is None:
            strategy = tiled_default(q.device, shapes.head_dim, shapes.value_dim)
        validate_ring(shapes, layout, timeout, strategy, BLOCK_STRATEGIES)
    if strategy != "auto":
        reason = unavailable_reason(strategy, q.device)
        if reason is not None:
            raise RuntimeError(reason)
    if scheme == "ring":  # ValueError for sizes it cannot take
        REGISTRY[strategy].tiles(shapes, q.dtype, None, None)
    ring_group = _ring_group(group)
    if ring_group is None:
        return attention(
            q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=True, strategy=strategy, return_lse=return_lse, sinks=sinks,
            generator=generator, window=window, softcap=softcap,
        )  # fmt: skip
    s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    comm = RingComm(ring_group, float(timeout))
    settings = Settings(is_causal, layout, s, float(dropout_p), scheme, window, softcap)
    if scheme == "all_to_all":
        kw = Keywords(is_causal, scale, strategy, window, softcap)
        out, lse_a = all_to_all_attention(
            comm, q, k, v, shapes, settings, kw, attn_mask, sink, generator, return_lse
        )
        return (out, lse_a) if lse_a is not None else out
    mask = shard_mask(attn_mask, q, shapes, comm.world, is_causal)
    wants = [n for n, t in zip("qkv", (q, k, v), strict=True) if t.requires_grad]
    wants += ["attn_mask"] if mask is not None and mask.requires_grad else []
    wants += ["sinks"] if sink is not None and sink.requires_grad else []
    settings = replace(
        settings,
        mask=() if mask is None else (tensor_kind(mask), *mask.shape),
        # the second-order path's graph must be one on every rank
        requires_grad=tuple(wants) if torch.is_grad_enabled() else (),
    )
    check_same_shards(comm, q, shapes, settings)
    dropout = shared_dropout(comm, dropout_p, q.device, generator)
    n = shapes.seq_q
    b, hq, hkv = shapes.batch, shapes.heads_q, shapes.heads_kv
    qb = q.reshape(b, hq, n, shapes.head_dim)  # (B, Hq, n, d)
    # k/v are sent as they are: contiguous
    kb = k.reshape(b, hkv, n, shapes.head_dim).contiguous()  # (B, Hkv, n, d)
    vb = v.reshape(b, hkv, n, shapes.value_dim).contiguous()  # (B, Hkv, n, dv)
    ring = _Ring(
        comm, layout, is_causal, REGISTRY[strategy], dropout, window, softcap, mask is not None
    )
    bias, keep = (None, mask) if mask is not None and mask.dtype == torch.bool else (mask, None)
    o, lse_, _ = RingAttention.apply(qb, kb, vb, bias, keep, ring, s)  # type: ignore[no-untyped-call]
    out = o.reshape(*shapes.lead, hq, n, shapes.value_dim)
    lse_ = lse_.reshape(*shapes.lead, hq, n)
    if sink is not None:  # once per row, after every key's partial has been merged
        out, lse_ = merge_sinks(out, lse_, sink)
    out, lse_ = out.reshape(shapes.out_shape), lse_.reshape(shapes.lse_shape)  # headless: [n, ...]
    return (out, lse_) if return_lse else out
