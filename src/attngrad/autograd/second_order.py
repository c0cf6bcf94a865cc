r"""The backward of the backward: second derivatives of attention, tile by tile.

First order (per batch and head; s = scale, dlse the cotangent of lse)::

    dV = P^T dO      dP = dO v^T      Delta = rowsum(P * dP)
    dS = P * Y,  Y = dP - Delta + dlse
    dq = s dS k      dk = s dS^T q      dbias = dS

Differentiating <g_q, dq> + <g_k, dk> + <g_v, dV> + <g_bias, dbias> for the
cotangents g of the four gradients (`attngrad.autograd.linearized`):
G = L(g) = s (g_q k^T + q g_k^T) + g_bias carries the first three through
dS, so the scalar is <G, P * Y> + <g_v, P^T dO> plus the direct terms
s dS g_k (for q) and s dS^T g_q (for k).  Then, with P-hat the cotangent of
P and D-hat that of dP::

    r     = rowsum(P * G)                       (the cotangent of dlse)
    D-hat = P * (G - r)
    P-hat = G * Y - r dP + dO g_v^T
    S-hat = P * (P-hat - rowsum(P * P-hat))     (softmax's backward of P-hat)

    grad q    = s (S-hat k + dS g_k)        grad k = s (S-hat^T q + dS^T g_q)
    grad v    = D-hat^T dO                  grad bias = S-hat
    grad dO   = P g_v + D-hat v             grad dlse = r

With c = Delta - dlse (so Y = dP - c) and H = G - r, P-hat = H * Y - r c +
dO g_v^T, and since each live row of P sums to 1 the row constant drops out
of S-hat::

    D-hat = P * H        S-hat = P * (H * Y + dO g_v^T - rho')
    rho'  = rowsum(P * H * Y) + rowsum(dO * u) = rowsum(P G dP) - r Delta + rowsum(dO * u)

Every term is a tile's elementwise product or a matmul with q, k, v, dO
rows, except the row sums Delta, r and rho' and the rows u = P g_v: a first
pass over each block of query rows accumulates them (O(Nq) floats, and
Nq x dv for u), a second pass walks key blocks as flash's backward does
and accumulates the gradients.  The row sums (`row_sums`: Delta, r,
rowsum(P G dP), rowsum(dO * u)) add up over key blocks, so where the keys
are sharded (ring attention) each block's first pass gives its share, and
the second pass runs per block given their totals (``sums``), adding its
block's P g_v to grad dO itself.  No tensor beyond one [block_q, block_k]
tile per (batch, head) is formed; P comes from the strategy's
``probabilities`` (the saved P, or rebuilt from the row statistics).
A row that attends nothing has P = 0 and so contributes nothing.

Dropout (O = (P * M) v, M = Z / (1 - p), Z regenerated per tile) puts M on
each path through v: dP = (dO v^T) * M (so Y, Delta and D-hat's products
with v and dO take it), u = (P * M) g_v, and P-hat's g_v term is
M * (dO g_v^T).  The score modifications between S = scale q k^T and the mask
(`attngrad.core.modification`: a softcap, a score function, the bias) make
G = J (G_raw, g_theta) with G_raw = s (g_q k^T + q g_k^T) and g_theta the
cotangents of their tensors' gradients (g_bias for the bias), the chain's push
(`attngrad.autograd.linearized`); S-hat and dS go back through the chain, each
modification f taking them onto its input as J_x^T S-hat + d/dx <dS, J (x-dot,
g_theta)> and J_x^T dS, its tensors' gradients being the theta part of the same
(`attngrad.core.modification.Chain.second_`): the bias's is S-hat itself; a
softcap's (slope sigma' = 1 - tanh^2, curvature sigma'' = -2 tanh sigma' / c)
S-hat * sigma' + x-dot * dS * sigma''.  The direct terms take dS at the raw
scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attngrad.autograd.linearized import Direction, tile_inputs
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Problem, Saved, Strategy
from attngrad.core.ops import join_lse_cotangent_
from attngrad.core.probabilities import ProbabilityTiles, rebuilt_records
from attngrad.core.tiling import Blocks, key_schedule, schedule

__all__ = ["ROW_SUMS", "accumulators", "row_sums", "second_order", "second_order_of", "sums_of"]

Cotangents = tuple[torch.Tensor | None, ...]  # (g_q, g_k, g_v, g_bias, *g_captured)

# The row sums, in this order on the last dim: rowsum(P dP) = Delta, r = rowsum(P G),
# rowsum(P G dP) and rowsum(dO * u), u = P g_v; rho' = the third - r Delta + the fourth.
ROW_SUMS = 4


def accumulators(
    likes: Sequence[torch.Tensor | None], wanted: Sequence[bool], dtype: torch.dtype
) -> tuple[torch.Tensor | None, ...]:
    """Zeroed gradient accumulators, one per tensor of ``likes`` that ``wanted`` asks for and
    that is floating-point, shaped like it in its dtype promoted with the compute ``dtype``;
    None for the rest."""
    return tuple(
        None
        if t is None or not w or not t.is_floating_point()
        else torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, dtype), device=t.device)
        for t, w in zip(likes, wanted, strict=True)
    )


@dataclass(frozen=True)
class _Pass:
    """What both passes read, heads grouped by kv head: q5 [B, Hkv, G, Nq, d], do5 like it
    with dv, k and v in the compute dtype, g_v (or None), the direction's tangents, the
    tiles of P (rebuilt or saved) and of dropout's multipliers (or None)."""

    problem: Problem[Any]
    blocks: Blocks
    direction: Direction
    p_tile: ProbabilityTiles
    multipliers: Callable[[slice, slice], torch.Tensor] | None
    q5: torch.Tensor
    do5: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gv: torch.Tensor | None

    @staticmethod
    def of(
        strategy: Strategy[Any],
        problem: Problem[Any],
        saved: Saved,
        cotangents: Cotangents,
        dout: torch.Tensor,
    ) -> _Pass:
        g_q, g_k, g_v, g_bias, *g_captured = cotangents
        dtype, hkv = problem.dtype, problem.k.shape[1]
        direction, p_tile, multipliers = tile_inputs(
            strategy, problem, saved, (g_q, g_k, g_bias, *g_captured)
        )
        return _Pass(
            problem, strategy.pass_blocks(problem), direction, p_tile, multipliers,
            group_heads(problem.q, hkv), group_heads(dout.to(dtype), hkv),
            problem.k.to(dtype), problem.v.to(dtype), None if g_v is None else g_v.to(dtype),
        )  # fmt: skip

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.problem.dtype, device=self.problem.q.device)

    def dp_tile(
        self, do_r: torch.Tensor, rows: slice, keys: slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(P, dP = (dO v^T) * M, M or None) of the tile."""
        p = self.p_tile(rows, keys)
        m = None if self.multipliers is None else self.multipliers(rows, keys)  # Z / (1 - p)
        dp = torch.matmul(do_r, self.v[:, :, keys].transpose(-2, -1))
        if m is not None:
            dp.mul_(m)
        return p, dp, m


def _first_pass(x: _Pass, keep_u: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row sums [B, Hkv, G, Nq, ROW_SUMS] and, with ``keep_u``, u = P g_v [B, Hkv, G,
    Nq, dv] (None without g_v)."""
    pb, direction, gv = x.problem, x.direction, x.gv
    b, hkv, g, nq, _ = x.q5.shape
    dv_dim = x.v.shape[-1]
    sums = x.zeros(b, hkv, g, nq, ROW_SUMS)
    u = None if gv is None or not keep_u else x.zeros(b, hkv, g, nq, dv_dim)
    for rows, key_tiles in schedule(pb.mods, x.blocks):
        n = rows.stop - rows.start
        q_r, do_r = take_rows(x.q5, rows).to(pb.dtype), take_rows(x.do5, rows)
        part = x.zeros(b, hkv, g * n, ROW_SUMS)
        delta_r, r_r, pgdp, pu = part.unbind(-1)
        u_r = None if gv is None else x.zeros(b, hkv, g * n, dv_dim)
        for keys in key_tiles:
            p, dp, m = x.dp_tile(do_r, rows, keys)
            delta_r += (p * dp).sum(-1)
            if not direction.zero:
                records = rebuilt_records(pb.mods, q_r, x.k[:, :, keys], pb.scale, rows, keys)
                pg = direction.tangents(q_r, x.k, rows, keys, records)[-1].mul_(p)
                r_r += pg.sum(-1)
                pgdp += pg.mul_(dp).sum(-1)
            if u_r is not None and gv is not None:
                u_r += torch.matmul(p if m is None else p * m, gv[:, :, keys])
        if u_r is not None:
            pu += (do_r * u_r).sum(-1)
            if u is not None:
                u[:, :, :, rows] = u_r.view(b, hkv, g, n, dv_dim)
        sums[:, :, :, rows] = part.view(b, hkv, g, n, ROW_SUMS)
    return sums, u


def row_sums(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    cotangents: Cotangents,
    dout: torch.Tensor,
) -> torch.Tensor:
    """The row sums (`ROW_SUMS`) of the second-order pass over this call's keys, [B, Hq, Nq,
    4] in the compute dtype, from the shared tiled first pass: over one block of a sharded
    sequence's keys, that block's share (the shares add up to the sums over every key)."""
    sums, _ = _first_pass(_Pass.of(strategy, problem, saved, cotangents, dout), keep_u=False)
    b, hq, nq = problem.q.shape[:3]
    return sums.view(b, hq, nq, ROW_SUMS)


def second_order(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    cotangents: Cotangents,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    need: tuple[bool, ...],
    sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of <g, (dq, dk, dv, dbias, *dcaptured)> w.r.t. (dout, dlse, q, k, v, bias,
    *captured).

    cotangents g = (g_q, g_k, g_v, g_bias, *g_captured): like q, k, v, the bias
    and the score function's captured tensors, None for zero.  dout:
    [B, Hq, Nq, dv]; dlse: [B, Hq, Nq] or None; saved: the strategy's saved
    tensors.  ``need``: which to return (the rest come back None).  sums: None,
    or the row sums over every key [B, Hq, Nq, 4] (`row_sums`'s, summed over
    the key blocks) where k and v are one block of the keys: the gradients are
    then that block's share (grad dlse = r, the whole).  Results are in the
    compute dtype.
    """
    x = _Pass.of(strategy, problem, saved, cotangents, dout)
    q, k, v, mods, scale = problem.q, x.k, x.v, problem.mods, problem.scale
    b, hq, nq, d = q.shape
    hkv, dv_dim = k.shape[1], v.shape[-1]
    g = hq // hkv
    dtype = problem.dtype
    if sums is None:
        totals, u = _first_pass(x, keep_u=True)
    else:
        totals, u = group_heads(sums.to(dtype), hkv), None  # P g_v joins grad dO per tile
    delta, r_sum, pgdp, pu = (t.unsqueeze(-1) for t in totals.unbind(-1))
    rho = pgdp - r_sum * delta + pu  # rho'
    c_row = delta.clone()  # c = Delta - dlse
    join_lse_cotangent_(c_row, None if dlse is None else group_heads(dlse.unsqueeze(-1), hkv))
    q5, do5, gv, direction = x.q5, x.do5, x.gv, x.direction

    # pass 2, by key blocks: the gradients
    need_dout, need_dlse, need_q, need_k, need_v, need_bias = need[:6]
    grad_captured = accumulators(mods.captured, need[6:], dtype)
    grad_q = x.zeros(b, hkv, g, nq, d) if need_q else None
    grad_k = x.zeros(*k.shape) if need_k else None
    grad_v = x.zeros(*v.shape) if need_v else None
    grad_do = x.zeros(b, hkv, g, nq, dv_dim) if need_dout else None
    grad_bias = None
    if need_bias and mods.bias is not None:
        grad_bias = x.zeros(*mods.bias.shape)
    grads = mods.chain.parameters_of(grad_bias, grad_captured)  # of the modifications' tensors
    a_q, a_k = direction.a_q, direction.a_k  # scale * g_q, scale * g_k
    for _, pairs in key_schedule(mods, x.blocks):
        for rows, keys in pairs:
            n, c = rows.stop - rows.start, keys.stop - keys.start
            q_r, do_r = take_rows(q5, rows).to(dtype), take_rows(do5, rows)
            kc, vc = k[:, :, keys], v[:, :, keys]
            p, y, m = x.dp_tile(do_r, rows, keys)
            y.sub_(take_rows(c_row, rows))  # Y = dP - c
            ds = p * y
            records = rebuilt_records(mods, q_r, kc, scale, rows, keys)
            tangents = None  # the direction at each modification's input, then G
            t = None  # H * Y + dO g_v^T * M - rho', then S-hat = P * t
            if not direction.zero:
                tangents = direction.tangents(q_r, k, rows, keys, records)
                # out of place: the tangents are read again on the way back through the chain
                h = tangents[-1] - take_rows(r_sum, rows)  # G - r
                if grad_v is not None or grad_do is not None:
                    d_hat = p * h
                    if m is not None:  # through dP = (dO v^T) * M
                        d_hat.mul_(m)
                    if grad_v is not None:
                        grad_v[:, :, keys] += torch.matmul(d_hat.transpose(-2, -1), do_r)
                    if grad_do is not None:
                        grad_do[:, :, :, rows] += torch.matmul(d_hat, vc).view(b, hkv, g, n, -1)
                t = h.mul_(y)
            if gv is not None:
                gvt = gv[:, :, keys].transpose(-2, -1)
                if grad_do is not None and u is None:  # this block's share of u = (P M) g_v
                    pm = p if m is None else p * m
                    grad_do[:, :, :, rows] += torch.matmul(pm, gv[:, :, keys]).view(
                        b, hkv, g, n, -1
                    )
                if m is not None:  # through dV = (P * M)^T dO: M * (dO g_v^T)
                    dog = torch.matmul(do_r, gvt).mul_(m)
                    t = dog if t is None else t.add_(dog)
                elif t is None:
                    t = torch.matmul(do_r, gvt)
                else:  # added inside the matmul
                    t.view(-1, g * n, c).baddbmm_(
                        do_r.reshape(-1, g * n, dv_dim), gvt.reshape(-1, dv_dim, c)
                    )
            s_hat = None if t is None else t.sub_(take_rows(rho, rows)).mul_(p)
            # back through the score modifications: S-hat and dS onto the raw scores
            s_hat = mods.chain.second_(
                ds, s_hat, rows, keys, records, tangents, direction.dots, grads
            )
            if grad_q is not None:
                part = (
                    torch.zeros_like(q_r) if s_hat is None else torch.matmul(s_hat, kc).mul_(scale)
                )
                if a_k is not None:
                    part += torch.matmul(ds, a_k[:, :, keys])
                grad_q[:, :, :, rows] += part.view(b, hkv, g, n, d)
            if grad_k is not None:
                part = (
                    torch.zeros_like(kc)
                    if s_hat is None
                    else torch.matmul(s_hat.transpose(-2, -1), q_r).mul_(scale)
                )
                if a_q is not None:
                    part += torch.matmul(ds.transpose(-2, -1), take_rows(a_q, rows))
                grad_k[:, :, keys] += part
    if grad_do is not None and u is not None:
        grad_do += u
    return (
        None if grad_do is None else grad_do.view(b, hq, nq, dv_dim),
        r_sum.reshape(b, hq, nq) if need_dlse else None,
        None if grad_q is None else grad_q.view(b, hq, nq, d),
        grad_k,
        grad_v,
        grad_bias,
        *grad_captured,
    )


def second_order_of(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    cotangents: Cotangents,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    need: tuple[bool, ...],
    sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """`second_order` in the strategy's own kernels where it has them
    (`attngrad.core.interface.Strategy.second_order`), else the shared tiled pass."""
    grads = strategy.second_order(problem, saved, cotangents, dout, dlse, need, sums)
    if grads is None:
        grads = second_order(strategy, problem, saved, cotangents, dout, dlse, need, sums)
    return grads


def sums_of(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    cotangents: Cotangents,
    dout: torch.Tensor,
) -> torch.Tensor:
    """`row_sums` in the strategy's own kernels where it has them
    (`attngrad.core.interface.Strategy.second_sums`), else the shared tiled first pass."""
    sums = strategy.second_sums(problem, saved, cotangents, dout)
    return row_sums(strategy, problem, saved, cotangents, dout) if sums is None else sums
