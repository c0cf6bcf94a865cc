"""Strategy "explicit": forward saves q, k, v and the whole probability matrix P.

Backward is the four local ops of `attngrad.ops` on the saved P:
dV = P^T dO, dP = dO v^T, dS = P * (dP - rowsum(P * dP)), dq/dk = scale * dS k / dS^T q.
Saved bytes: b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + b * B*Hq*Nq*Nk.

Both passes walk P in chunks of query rows, whole key range each: a chunk of
S, dP and dS stays in cache between the matmuls that make and use it, so the
matmuls run at their cache-resident rate instead of streaming [Nq, Nk]
matrices through memory.  P itself is written once and read once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from attngrad import ops
from attngrad.heads import group_heads, take_rows
from attngrad.masks import Mask, add_bias_gradient_, bias_meta

__all__ = [
    "ExplicitAttention",
    "attention",
    "explicit_backward",
    "explicit_forward",
    "masked_scores",
    "row_chunks",
]

# Bytes of one chunk of scores across all (batch, head) pairs: small enough to
# stay in this class of CPU's L2/L3 between the matmul that writes it and the
# ops that read it, large enough that each matmul has rows to work with.
CHUNK_BYTES = 8 * 2**20


def row_chunks(q: torch.Tensor, nk: int) -> Iterator[slice]:
    """Slices of query rows whose [B, Hq, rows, Nk] float32 scores fill ~CHUNK_BYTES."""
    b, hq, nq, _ = q.shape
    rows = max(16, CHUNK_BYTES // max(1, 4 * b * hq * nk))
    for r0 in range(0, nq, rows):
        yield slice(r0, min(r0 + rows, nq))


def masked_scores(
    q5: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float, rows: slice
) -> torch.Tensor:
    """Masked scores of query rows ``rows`` against every key, in the compute dtype.

    q5: [B, Hkv, G, Nq, d] (grouped query heads), k: [B, Hkv, Nk, d] in the
    compute dtype -> S: [B, Hkv, G, r, Nk].  Forward and the recompute
    backward both call this, so S is bit for bit the same in both.
    """
    b, hkv, g = q5.shape[:3]
    r = rows.stop - rows.start
    s = ops.scores(take_rows(q5, rows).to(k.dtype), k, scale)  # (B, Hkv, G*r, Nk)
    return mask.apply_(s.view(b, hkv, g, r, k.shape[2]), rows)


def _dead(dead: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """Rows ``rows`` of `Mask.dead_rows` (which may broadcast along Nq)."""
    if dead is None or dead.shape[-1] == 1:
        return dead
    return dead[..., rows]


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """O, P and lse for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    Returns O: [B, Hq, Nq, dv] and P: [B, Hkv, G*Nq, Nk] (query heads folded per
    key/value group, see `attngrad.heads`) in the input dtype, and lse:
    [B, Hkv, G*Nq] in the compute dtype.
    """
    b, hq, nq, _ = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    q5, k, v = group_heads(q, hkv), k.to(dtype), v.to(dtype)
    p = q.new_empty(b, hkv, g, nq, nk)
    o = q.new_empty(b, hkv, g, nq, dv)
    lse = torch.empty(b, hkv, g, nq, dtype=dtype, device=q.device)
    dead = mask.dead_rows(q.device)
    for rows in row_chunks(q, nk):
        r = rows.stop - rows.start
        p_c, lse_c = ops.softmax_lse(masked_scores(q5, k, mask, scale, rows), _dead(dead, rows))
        p[:, :, :, rows] = p_c
        o[:, :, :, rows] = ops.attend(p_c.view(b, hkv, g * r, nk), v).view(b, hkv, g, r, dv)
        lse[:, :, :, rows] = lse_c
    return o.view(b, hq, nq, dv), p.view(b, hkv, g * nq, nk), lse.view(b, hkv, g * nq)


def explicit_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    scale: float,
    needs: tuple[bool, ...],
    bias_meta: tuple[torch.Size, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias) from dout: [B, Hq, Nq, dv] and P: [B, Hkv, G*Nq, Nk].

    ``needs`` says which of (dq, dk, dv) to compute; the others are None.
    dbias is computed when ``bias_meta`` = (shape, dtype) of the bias is given.
    P is read, never written.  Gradients come back in their inputs' dtypes.
    """
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    need_dq, need_dk, need_dv = needs[:3]
    need_ds = need_dq or need_dk or bias_meta is not None
    q5, do5, p5 = group_heads(q, hkv), group_heads(dout, hkv), p.view(b, hkv, g, nq, nk)
    k, v = k.to(dtype), v.to(dtype)
    dq = torch.empty(b, hkv, g, nq, d, dtype=dtype, device=q.device) if need_dq else None
    dk = torch.zeros(b, hkv, nk, d, dtype=dtype, device=q.device) if need_dk else None
    dv = torch.zeros(b, hkv, nk, dv_dim, dtype=dtype, device=q.device) if need_dv else None
    dbias = None
    if bias_meta is not None:
        dbias = torch.zeros(bias_meta[0], dtype=dtype, device=q.device)
    for rows in row_chunks(q, nk):
        r = rows.stop - rows.start
        p_c = take_rows(p5, rows).to(dtype)  # (B, Hkv, G*r, Nk)
        do_c = take_rows(do5, rows).to(dtype)  # (B, Hkv, G*r, dv)
        if dv is not None:
            dv += ops.value_gradient(p_c, do_c)
        if not need_ds:
            continue
        ds = ops.softmax_backward_(p_c, ops.probability_gradient(do_c, v))
        if dbias is not None:
            add_bias_gradient_(dbias, ds.view(b, hkv, g, r, nk), rows)
        if need_dq or need_dk:
            dq_c, dk_c = ops.query_key_gradients(ds, take_rows(q5, rows).to(dtype), k, scale)
            if dq is not None:
                dq[:, :, :, rows] = dq_c.view(b, hkv, g, r, d)
            if dk is not None:
                dk += dk_c
    grads = (
        None if dq is None else dq.view(b, hq, nq, d).to(q.dtype),
        None if dk is None else dk.to(q.dtype),
        None if dv is None else dv.to(q.dtype),
    )
    bias_grad = None if dbias is None or bias_meta is None else dbias.to(bias_meta[1])
    return (*grads, bias_grad)


class ExplicitAttention(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    ``bias`` and ``keep`` are ``mask.tensors`` passed as arguments so that
    autograd routes the bias gradient ([Bm, Hm, Nqm, Nkm], like the bias).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        mask: Mask,
        scale: float,
    ) -> torch.Tensor:
        o, p, _ = explicit_forward(q, k, v, mask.with_tensors(bias, keep), scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        ctx.bias_meta = bias_meta(bias)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        meta = ctx.bias_meta if ctx.needs_input_grad[3] else None
        grads = explicit_backward(dout, q, k, v, p, ctx.scale, ctx.needs_input_grad, meta)
        return (*grads, None, None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return ExplicitAttention.apply(q, k, v, *mask.tensors, mask, scale)
