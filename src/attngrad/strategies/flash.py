"""Strategy "flash": tiled attention with an online softmax, O(N) saved memory.

Forward walks key tiles for each block of query rows, keeping a running row
max ``m_i``, running sum ``l_i`` and a rescaled accumulator ``acc``, and never
holds more than one [block_q, block_k] score tile per (batch, head); it writes
O and the row statistics stats = (m, log l) (see `attngrad.core.ops`).  Backward walks the same tiles key
block by key block (dK and dV of a block accumulate in place inside the
matmuls), recomputes each P tile from the statistics and uses
Delta = rowsum(dO * O) in place of rowsum(P * dP):

    P = exp((S - m) - log l)   dV += P^T dO   dP = dO v^T   dS = P * (dP - Delta)
    dq += scale * dS k   dk += scale * dS^T q   dbias[tile] += dS

With dropout, forward accumulates (P * Z) v (l from the undropped P) and
scales O by 1 / (1 - p) once; backward regenerates each tile's Z, takes dV
from (P * Z) and dS = P * (dP * Z - Delta) = (P * Z) * dP - P * Delta, with
dO pre-scaled by 1 / (1 - p).  The score modifications (softcap, a score
function, the bias) keep their records of a tile as backward masks it again
(softcap's tanh, a score function's raw scores), and dS goes back through
them on its way to dq and dk, their tensors' gradients (dbias, the captured
tensors') taken on the way (`attngrad.core.modification.Chain.pullback_`).

Tiles that the band (causal, window, alignment, packed segments) masks
entirely are skipped.  Scores stay in
natural units until the row max is subtracted; exp runs as exp2 of the
difference times log2(e), never of a score itself (a bias of finfo.min times
log2(e) would overflow).  Saved bytes: b * (B*Hq*Nq*(d + dv) + B*Hkv*Nk*(d + dv))
+ 2 * l * B*Hq*Nq, plus the caller's mask when given (`Flash.saves`).
"""

from __future__ import annotations

import math

import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Backward, Problem, Saved
from attngrad.core.ops import LOG2E, log_normalizer, probabilities_
from attngrad.core.tiling import Blocks, key_schedule, schedule, tile_sizes
from attngrad.strategies.base import AttentionFunction
from attngrad.strategies.common import KeepsOutput

__all__ = ["Flash", "FlashAttention", "strategy"]

_NEG_INF = float("-inf")


def _scratch(buf: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous [*shape] tensor in the front of ``buf``'s storage (a tile's workspace)."""
    return buf.view(-1)[: math.prod(shape)].view(shape)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """[B, H, n, x] -> [B*H, n, x] for the in-place batched matmuls; a view."""
    return t.reshape(-1, *t.shape[-2:])


def _accumulate(acc: torch.Tensor, local: slice, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc[:, :, local] += a @ b, inside the matmul when ``local`` spans all of acc.

    acc: [B, H, c, x] contiguous; a: [B, H, n, m], b: [B, H, m, x].  A partial
    slice is strided across heads, where an in-place batched matmul would fall
    back to one matmul per head: it gets a fresh product added instead.
    """
    if local.stop - local.start == acc.shape[2]:
        _batched(acc).baddbmm_(_batched(a), _batched(b))
    else:
        acc[:, :, local] += torch.matmul(a, b)


class FlashAttention(AttentionFunction):
    """`AttentionFunction` of strategy "flash" (FlashAttentionBackward in the graph)."""


class Flash(KeepsOutput[Blocks]):
    """Tiles in tensor ops: the online-softmax forward, the key-block backward."""

    name = "flash"
    function = FlashAttention

    def tiles(
        self, shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
    ) -> Blocks:
        """`attngrad.core.tiling.tile_sizes`: the given sizes or the measured defaults."""
        return tile_sizes(shapes, block_q, block_k)

    def pass_blocks(self, problem: Problem[Blocks]) -> Blocks:
        """Its own tiles."""
        return problem.tiles

    def forward(self, problem: Problem[Blocks]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] (input dtype) and {"o": O, "stats": [B, Hq, Nq, 2]} (compute dtype).

        stats = (m, log l), per query row.
        """
        q, mods, scale, blocks = problem.q, problem.mods, problem.scale, problem.tiles
        b, hq, nq, _ = q.shape
        hkv, dv = problem.k.shape[1], problem.v.shape[-1]
        g = hq // hkv
        dtype = problem.dtype
        q5 = group_heads(q, hkv)  # (B, Hkv, G, Nq, d)
        k, v = problem.k.to(dtype), problem.v.to(dtype)
        o = q.new_empty(b, hq, nq, dv)  # a base tensor, not a view: callers may edit it in place
        o5 = group_heads(o, hkv)
        stats = torch.empty(b, hkv, g, nq, 2, dtype=dtype, device=q.device)
        # one workspace for every score tile: a fresh multi-MiB tensor per tile costs page faults
        work = torch.empty(b * hkv * g * blocks[0] * blocks[1], dtype=dtype, device=q.device)
        drop = None if mods.dropout is None else mods.dropout.tiles(q, k, dtype)
        for rows, key_tiles in schedule(mods, blocks):
            r = rows.stop - rows.start
            qb = take_rows(q5, rows).to(dtype) * scale  # (B, Hkv, G*r, d)
            m_i = torch.full((b, hkv, g * r, 1), _NEG_INF, dtype=dtype, device=q.device)
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros(b, hkv, g * r, dv, dtype=dtype, device=q.device)
            shift = torch.zeros_like(m_i)
            for cols in key_tiles:
                c = cols.stop - cols.start
                qk = _scratch(work, b, hkv, g * r, c)  # (B, Hkv, G*r, c)
                torch.matmul(qb, k[:, :, cols].transpose(-2, -1), out=qk)
                mods.apply_(qk.view(b, hkv, g, r, c), rows, cols)
                m_new = torch.maximum(m_i, qk.amax(dim=-1, keepdim=True))
                # a row with no key yet keeps m = -inf; shift by 0 so exp(-inf) = 0, not NaN
                shift = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                p = qk.sub_(shift).mul_(LOG2E).exp2_()
                alpha = torch.exp2((m_i - shift) * LOG2E)
                l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # l of the undropped P
                if drop is not None:  # P * Z; the 1 / (1 - p) is applied to O once
                    Dropout.apply_(p, drop(rows, cols))
                _batched(acc.mul_(alpha)).baddbmm_(_batched(p), _batched(v[:, :, cols]))
                m_i = m_new
            if mods.dropout is not None:
                acc.mul_(mods.dropout.scale)
            o5[:, :, :, rows] = acc.div_(l_i.masked_fill(l_i == 0, 1.0)).view(b, hkv, g, r, dv)
            stats[:, :, :, rows] = torch.cat((shift, log_normalizer(l_i)), -1).view(b, hkv, g, r, 2)
        return o, {"o": o, "stats": stats.view(b, hq, nq, 2)}

    def backward_into(self, backward: Backward[Blocks]) -> None:
        """Add this call's gradients, tile by tile, into backward.grads = (dq, dk, dv, dbias).

        dq: like q, dk: like k, dv: like v, in the compute dtype (views of larger
        accumulators are fine, e.g. ring attention's); dbias: like the bias; None
        for any not wanted.  saved: `forward`'s O and stats, or (ring attention)
        the final O and stats of these rows over every key.  Key block by key block
        (`key_schedule`): the block's dK and dV sit in contiguous buffers that
        the matmuls add into in place and are added out once; dq rows gather one
        small product per tile.  Each tile's rows of q are scaled as the tile
        needs them: a scaled copy of all of q would cost q's size for no
        measured gain.
        """
        problem, saved = backward.problem, backward.saved
        q, mods, scale, blocks = problem.q, problem.mods, problem.scale, problem.tiles
        dq, dk, dv, dbias = backward.grads
        o, stats = saved["o"], saved["stats"]
        b, hq, _, d = q.shape
        hkv, dv_dim = problem.k.shape[1], problem.v.shape[-1]
        g = hq // hkv
        dtype = problem.dtype
        do = backward.dout.to(dtype)  # converted once, for Delta and the tiles
        do5 = group_heads(do, hkv)  # (B, Hkv, G, Nq, dv)
        # Delta = rowsum(dO * O) - dlse: lse's cotangent joins Delta, dS = P * (dP - Delta + dlse)
        delta = group_heads(ops.delta(do, o, backward.dlse, dtype), hkv).unsqueeze(-1)
        dropout = mods.dropout
        if dropout is not None:  # dV = (P * Z)^T dO / (1 - p), dP = (dO v^T) * Z / (1 - p)
            do5 = do5 * dropout.scale
        drop = None if dropout is None else dropout.tiles(q, problem.k, dtype)
        stats5 = group_heads(stats, hkv)  # (B, Hkv, G, Nq, 2)
        q5, dq5 = group_heads(q, hkv), None if dq is None else group_heads(dq, hkv)
        k, v = problem.k.to(dtype), problem.v.to(dtype)
        work_p = torch.empty(b * hkv * g * blocks[0] * blocks[1], dtype=dtype, device=q.device)
        work_ds = torch.empty_like(work_p)
        # the modifications' records of a tile (None where one keeps none)
        work_records = [torch.empty_like(work_p) if m.records else None for m in mods.chain.links]
        dtheta = mods.chain.parameters_of(dbias, backward.dcaptured)  # their tensors' gradients
        work_dk = torch.empty(b * hkv * blocks[1] * d, dtype=dtype, device=q.device)
        work_dv = torch.empty(b * hkv * blocks[1] * dv_dim, dtype=dtype, device=q.device)
        for cols, tiles in key_schedule(mods, blocks):
            c = cols.stop - cols.start
            dk_c = _scratch(work_dk, b, hkv, c, d).zero_()
            dv_c = _scratch(work_dv, b, hkv, c, dv_dim).zero_()
            for rows, keys in tiles:
                r, n = rows.stop - rows.start, keys.stop - keys.start
                local = slice(keys.start - cols.start, keys.stop - cols.start)
                qb = take_rows(q5, rows).to(dtype) * scale  # (B, Hkv, G*r, d), fresh
                dob = take_rows(do5, rows)  # (B, Hkv, G*r, dv)
                stats_b, delta_b = (
                    take_rows(stats5, rows),
                    take_rows(delta, rows),
                )  # (.., G*r, 2 | 1)
                kc, vc = k[:, :, keys], v[:, :, keys]
                qk = _scratch(work_p, b, hkv, g * r, n)  # (B, Hkv, G*r, n)
                torch.matmul(qb, kc.transpose(-2, -1), out=qk)
                records = [
                    None if w is None else _scratch(w, b, hkv, g, r, n) for w in work_records
                ]
                mods.apply_(qk.view(b, hkv, g, r, n), rows, keys, records)
                p = probabilities_(qk, stats_b)
                dp = _scratch(work_ds, b, hkv, g * r, n)
                torch.matmul(dob, vc.transpose(-2, -1), out=dp)
                if drop is None:
                    _accumulate(dv_c, local, p.transpose(-2, -1), dob)  # dV += P^T dO
                    ds = dp.sub_(delta_b).mul_(p)  # (B, Hkv, G*r, n)
                else:
                    pz = Dropout.dropped(p, drop(rows, keys))
                    _accumulate(dv_c, local, pz.transpose(-2, -1), dob)  # dV += (P * Z)^T dO
                    ds = dp.mul_(pz).addcmul_(p, delta_b, value=-1.0)  # P * (dP * Z - Delta)
                mods.chain.pullback_(ds, rows, keys, records, dtheta)  # dS' -> dS
                if dq5 is not None:
                    dq5[:, :, :, rows] += torch.matmul(ds, kc).view(b, hkv, g, r, d).mul_(scale)
                _accumulate(dk_c, local, ds.transpose(-2, -1), qb)  # dK += dS^T (q * scale)
            if dk is not None:
                dk[:, :, cols] += dk_c
            if dv is not None:
                dv[:, :, cols] += dv_c


strategy = Flash()
