"""Strategy "explicit": forward saves q, k, v and the whole probability matrix P.

Backward is the four local ops of `attngrad.ops` on the saved P:
dV = P^T dO, dP = dO v^T, dS = P * (dP - rowsum(P * dP)), dq/dk = scale * dS k / dS^T q.
Saved bytes: b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + b * B*Hq*Nq*Nk.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from attngrad import ops
from attngrad.heads import fold_queries, unfold_queries
from attngrad.masks import Mask

__all__ = [
    "ExplicitAttention",
    "attention",
    "explicit_backward",
    "explicit_forward",
    "masked_scores",
]


def masked_scores(q: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float) -> torch.Tensor:
    """The whole masked score matrix in the compute dtype.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d] -> S: [B, Hkv, G*Nq, Nk] (query heads
    folded per key/value group, see `attngrad.heads`).
    """
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dtype = ops.compute_dtype(q.dtype)
    s = ops.scores(fold_queries(q, hkv).to(dtype), k.to(dtype), scale)  # (B, Hkv, G*Nq, Nk)
    mask.apply_(s.view(b, hkv, hq // hkv, nq, nk))  # (B, Hkv, G, Nq, Nk)
    return s


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """O, P and lse for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    Returns O: [B, Hq, Nq, dv] in the input dtype, and P: [B, Hkv, G*Nq, Nk]
    and lse: [B, Hkv, G*Nq] in the compute dtype.
    """
    s = masked_scores(q, k, mask, scale)
    b, hkv, rows, nk = s.shape
    dead = mask.dead_rows(q.device)
    p, lse = ops.softmax_lse(s.view(b, hkv, q.shape[1] // hkv, mask.seq_q, nk), dead)
    p = p.view_as(s)
    o = ops.attend(p, v.to(p.dtype))  # (B, Hkv, G*Nq, dv)
    return unfold_queries(o, q.shape[1]).to(q.dtype), p, lse.view(b, hkv, rows)


def explicit_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    scale: float,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dS) from dout: [B, Hq, Nq, dv] and P: [B, Hkv, G*Nq, Nk].

    ``needs`` says which of (dq, dk, dv, dS) to compute; the others are None.
    ``p`` must be in the compute dtype; it is read, never written.  dq, dk, dv
    come back in the input dtype, dS as [B, Hq, Nq, Nk] in the compute dtype.
    """
    need_dq, need_dk, need_dv, need_ds = needs
    hq, hkv, dtype = q.shape[1], k.shape[1], q.dtype
    do = fold_queries(dout, hkv).to(p.dtype)  # (B, Hkv, G*Nq, dv)
    dq = dk = dv = ds = None
    if need_dv:
        dv = ops.value_gradient(p, do).to(dtype)
    if need_dq or need_dk or need_ds:
        dp = ops.probability_gradient(do, v.to(p.dtype))
        ds = ops.softmax_backward_(p, dp)  # (B, Hkv, G*Nq, Nk)
        if need_dq or need_dk:
            qf = fold_queries(q, hkv).to(p.dtype)
            dq, dk = ops.query_key_gradients(ds, qf, k.to(p.dtype), scale)
            dq, dk = unfold_queries(dq, hq).to(dtype), dk.to(dtype)
        ds = unfold_queries(ds, hq)
    return dq, dk, dv, ds


def bias_gradient(
    ds: torch.Tensor | None, bias_meta: tuple[torch.Size, torch.dtype] | None
) -> torch.Tensor | None:
    """dbias = dS summed over the dims the bias was broadcast along, in its dtype.

    ``bias_meta`` is (shape, dtype) of the bias, or None when there is none.
    """
    if ds is None or bias_meta is None:
        return None
    shape, dtype = bias_meta
    return ds.sum_to_size(shape).to(dtype)


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
        ctx.save_for_backward(q, k, v, p.to(q.dtype))
        ctx.scale = scale
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        p = p.to(ops.compute_dtype(q.dtype))
        dq, dk, dv, ds = explicit_backward(dout, q, k, v, p, ctx.scale, needs)
        return dq, dk, dv, bias_gradient(ds, ctx.bias_meta), None, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return ExplicitAttention.apply(q, k, v, *mask.tensors, mask, scale)
