r"""Ring attention's backward: the k/v shards travel again, and each block's dK/dV with them.

Backward needs, for each block, only P = exp((S - m) - log l) with the
*final* statistics, and Delta = rowsum(dO * O) with the *final* O:

    dV_blk = P^T dO    dS = P * (dO v_blk^T - Delta + dlse)    dq += s dS k_blk    dK_blk = s dS^T q

so the block kernel's backward runs unchanged on each (q shard, k/v block)
pair.  k/v travel the ring again, and each block's dK/dV travel with it
(`attngrad.ring.blocks.carry_home`), collecting every rank's contribution,
until they reach their owner.  Each rank saves only its own q, k, v, O and
statistics: O(N/P) memory per rank.  With dropout, the mask is regenerated
per block at its global origin; a sink's gradient comes from autograd through
the merge after the ring (dlse reaches this pass).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from attngrad.core.interface import Backward
from attngrad.core.ops import compute_dtype
from attngrad.ring.blocks import (
    Ring,
    Tensors,
    block_pair,
    block_problem,
    carry_home,
    mask_block,
    rows_of,
)
from attngrad.ring.layout import Block

__all__ = ["HEAD_GROUPS", "Shard", "ring_backward", "ring_gradients"]


# Backward runs one ring per group of kv heads (at most this many groups): the
# buffers a rank holds for the ring (a remote k/v shard, its dK/dV accumulators)
# then cover only that group's heads, while the outputs stay whole.  With
# dropout or a mask one group: dropout's mask hashes each head's index among
# all Hq, and a mask's heads need not follow the kv heads'.
HEAD_GROUPS = 4


@dataclass(frozen=True)
class Shard:
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

    def heads(self, qh: slice, kh: slice) -> Shard:
        """The query heads ``qh`` and their kv heads ``kh`` (k, v made contiguous: they travel)."""
        assert self.mask == (None, None) and not self.captured  # these run as one group
        return Shard(
            self.q[:, qh], self.k[:, kh].contiguous(), self.v[:, kh].contiguous(), self.o[:, qh],
            self.stats[:, qh], self.dout[:, qh], None if self.dlse is None else self.dlse[:, qh],
        )  # fmt: skip


def ring_backward(
    shard: Shard, ring: Ring, scale: float
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
        dk_c, dv_c = _ring_backward_group(dq, shard, ring, scale, own_first=False)
        return dq.to(q.dtype), dk_c.to(k.dtype), dv_c.to(shard.v.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(shard.v)
    bounds = [hkv * i // groups for i in range(groups + 1)]
    for h0, h1 in itertools.pairwise(bounds):
        qh, kh = slice(h0 * g, h1 * g), slice(h0, h1)
        group = shard.heads(qh, kh)
        dk[:, kh], dv[:, kh] = _ring_backward_group(dq[:, qh], group, ring, scale, own_first=True)
    return dq.to(q.dtype), dk, dv


def _ring_backward_group(
    dq: torch.Tensor, shard: Shard, ring: Ring, scale: float, own_first: bool
) -> Tensors:
    """One ring pass for a group of heads: adds into ``dq`` (and the shard's dbias and
    dcaptured), returns this shard's dk, dv in the compute dtype (`carry_home`, which
    takes ``own_first``)."""
    q, o, stats, dout, dlse = shard.q, shard.o, shard.stats, shard.dout, shard.dlse

    def add_share(blocks: list[Block], shards: Tensors, accumulators: Tensors) -> None:
        (kc, vc), (dk, dv) = shards, accumulators
        for blk in blocks:
            problem = block_problem(
                ring, blk, q, kc, vc, scale, shard.mask, captured=shard.captured
            )
            if problem is None:
                continue
            dbias = mask_block(shard.dbias, blk)
            grads = (rows_of(dq, blk.rows), rows_of(dk, blk.cols), rows_of(dv, blk.cols), dbias)
            final = {"o": rows_of(o, blk.rows), "stats": rows_of(stats, blk.rows)}
            dlse_b = None if dlse is None else rows_of(dlse, blk.rows)
            pair = block_pair(ring, blk, problem.q, problem.k, problem.v)
            dcaptured = () if pair is None else pair.pick(shard.dcaptured)
            ring.strategy.backward_into(
                Backward(problem, final, rows_of(dout, blk.rows), dlse_b, grads, dcaptured)
            )

    kv = (shard.k, shard.v)
    return carry_home(ring, q.shape[2], kv, kv, add_share, own_first)


def ring_gradients(
    ring: Ring,
    scale: float,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    o: torch.Tensor,
    stats: torch.Tensor,
    captured: tuple[torch.Tensor, ...],
    need: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias, *dcaptured) of this rank's shard in their inputs' dtypes, from
    dout [B, Hq, n, dv] (None: zero) and dlse [B, Hq, n] (None: lse unused); shapes as
    `attngrad.ring.attention.ring_forward`'s, o and stats its outputs.  ``need``: (q, k, v,
    bias, *captured), whether each gradient is wanted (dq, dk, dv always come back; the
    others None where not wanted)."""
    if dout is None:
        dout = torch.zeros_like(o)
    dtype = compute_dtype(q.dtype)
    dbias = None
    if bias is not None and need[3]:
        dbias = torch.zeros(bias.shape, dtype=dtype, device=q.device)
    dcaptured = tuple(
        torch.zeros(t.shape, dtype=compute_dtype(t.dtype), device=t.device) if wanted else None
        for t, wanted in zip(captured, need[4:], strict=True)
    )
    shard = Shard(q, k, v, o, stats, dout, dlse, (bias, keep), dbias, captured, dcaptured)
    dq, dk, dv = ring_backward(shard, ring, scale)
    dbias_out = None if dbias is None or bias is None else dbias.to(bias.dtype)
    dcap = (None if g is None else g.to(t.dtype) for g, t in zip(dcaptured, captured, strict=True))
    return dq, dk, dv, dbias_out, *dcap
