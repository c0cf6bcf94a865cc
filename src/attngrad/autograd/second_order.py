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
and accumulates the gradients.  No tensor beyond one [block_q, block_k]
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

from collections.abc import Sequence
from typing import Any

import torch

from attngrad.autograd.linearized import tile_inputs
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Problem, Saved, Strategy
from attngrad.core.ops import join_lse_cotangent_
from attngrad.core.probabilities import rebuilt_records
from attngrad.core.tiling import key_schedule, schedule

__all__ = ["accumulators", "second_order"]

Cotangents = tuple[torch.Tensor | None, ...]  # (g_q, g_k, g_v, g_bias, *g_captured)


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


def _rowsum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=-1, keepdim=True)


def second_order(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    cotangents: Cotangents,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of <g, (dq, dk, dv, dbias, *dcaptured)> w.r.t. (dout, dlse, q, k, v, bias,
    *captured).

    cotangents g = (g_q, g_k, g_v, g_bias, *g_captured): like q, k, v, the bias
    and the score function's captured tensors, None for zero.  dout:
    [B, Hq, Nq, dv]; dlse: [B, Hq, Nq] or None; saved: the strategy's saved
    tensors.  ``need``: which to return (the rest come back None).  Results
    are in the compute dtype.
    """
    g_q, g_k, g_v, g_bias, *g_captured = cotangents
    q, k, v, mods, scale = problem.q, problem.k, problem.v, problem.mods, problem.scale
    b, hq, nq, d = q.shape
    hkv, dv_dim = k.shape[1], v.shape[-1]
    g = hq // hkv
    dtype = problem.dtype
    blocks = strategy.pass_blocks(problem)
    direction, p_tile, multipliers = tile_inputs(
        strategy, problem, saved, (g_q, g_k, g_bias, *g_captured)
    )
    q5, do5 = group_heads(q, hkv), group_heads(dout.to(dtype), hkv)
    k, v = k.to(dtype), v.to(dtype)
    gv = None if g_v is None else g_v.to(dtype)
    dlse5 = None if dlse is None else group_heads(dlse.to(dtype).unsqueeze(-1), hkv)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=q.device)

    # pass 1, by query rows: c = Delta - dlse, r, rho' and u = P g_v
    c_row, r_sum, rho = zeros(b, hkv, g, nq, 1), zeros(b, hkv, g, nq, 1), zeros(b, hkv, g, nq, 1)
    u = None if gv is None else zeros(b, hkv, g, nq, dv_dim)
    for rows, key_tiles in schedule(mods, blocks):
        n = rows.stop - rows.start
        q_r, do_r = take_rows(q5, rows).to(dtype), take_rows(do5, rows)
        delta_r, r_r, pgdp = (zeros(b, hkv, g * n, 1) for _ in range(3))
        u_r = None if gv is None else zeros(b, hkv, g * n, dv_dim)
        for keys in key_tiles:
            p = p_tile(rows, keys)
            m = None if multipliers is None else multipliers(rows, keys)  # Z / (1 - p)
            dp = torch.matmul(do_r, v[:, :, keys].transpose(-2, -1))
            if m is not None:
                dp.mul_(m)  # dP = (dO v^T) * M
            delta_r += _rowsum(p * dp)
            if not direction.zero:
                records = rebuilt_records(mods, q_r, k[:, :, keys], scale, rows, keys)
                pg = direction.tangents(q_r, k, rows, keys, records)[-1].mul_(p)
                r_r += _rowsum(pg)
                pgdp += _rowsum(pg.mul_(dp))
            if u_r is not None and gv is not None:
                u_r += torch.matmul(p if m is None else p * m, gv[:, :, keys])
        rho_r = pgdp.sub_(r_r * delta_r)  # rho' = rowsum(P G dP) - r Delta + rowsum(dO u)
        if u is not None and u_r is not None:
            rho_r += _rowsum(do_r * u_r)
            u[:, :, :, rows] = u_r.view(b, hkv, g, n, dv_dim)
        join_lse_cotangent_(delta_r, None if dlse5 is None else take_rows(dlse5, rows))
        for full, part in ((c_row, delta_r), (r_sum, r_r), (rho, rho_r)):
            full[:, :, :, rows] = part.view(b, hkv, g, n, 1)

    # pass 2, by key blocks: the gradients
    need_dout, need_dlse, need_q, need_k, need_v, need_bias = need[:6]
    grad_captured = accumulators(mods.captured, need[6:], dtype)
    grad_q = zeros(b, hkv, g, nq, d) if need_q else None
    grad_k = zeros(*k.shape) if need_k else None
    grad_v = zeros(*v.shape) if need_v else None
    grad_do = zeros(b, hkv, g, nq, dv_dim) if need_dout else None
    grad_bias = None
    if need_bias and mods.bias is not None:
        grad_bias = zeros(*mods.bias.shape)
    grads = mods.chain.parameters_of(grad_bias, grad_captured)  # of the modifications' tensors
    a_q, a_k = direction.a_q, direction.a_k  # scale * g_q, scale * g_k
    for _, pairs in key_schedule(mods, blocks):
        for rows, keys in pairs:
            n, c = rows.stop - rows.start, keys.stop - keys.start
            q_r, do_r = take_rows(q5, rows).to(dtype), take_rows(do5, rows)
            kc, vc = k[:, :, keys], v[:, :, keys]
            p = p_tile(rows, keys)
            m = None if multipliers is None else multipliers(rows, keys)  # Z / (1 - p)
            y = torch.matmul(do_r, vc.transpose(-2, -1))
            if m is not None:
                y.mul_(m)  # dP = (dO v^T) * M
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
        r_sum.view(b, hq, nq) if need_dlse else None,
        None if grad_q is None else grad_q.view(b, hq, nq, d),
        grad_k,
        grad_v,
        grad_bias,
        *grad_captured,
    )
