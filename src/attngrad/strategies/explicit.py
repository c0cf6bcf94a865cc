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

__all__ = ["ExplicitAttention", "attention", "explicit_backward", "explicit_forward"]


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O and P for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    Returns O: [B, Hq, Nq, dv] and P: [B, Hkv, G*Nq, Nk] (query heads folded
    per key/value group, see `attngrad.heads`).
    """
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    s = ops.scores(fold_queries(q, hkv), k, scale)  # (B, Hkv, G*Nq, Nk)
    s5 = mask.apply_(s.view(b, hkv, hq // hkv, nq, nk))  # (B, Hkv, G, Nq, Nk)
    p = ops.softmax(s5, mask.dead_rows()).view_as(s)
    o = ops.attend(p, v)  # (B, Hkv, G*Nq, dv)
    return unfold_queries(o, hq), p


def explicit_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    scale: float,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dS) from dout: [B, Hq, Nq, dv] and the saved P.

    ``needs`` says which of (dq, dk, dv, dS) to compute; the others are None.
    dS is returned as [B, Hq, Nq, Nk].
    """
    need_dq, need_dk, need_dv, need_ds = needs
    hq, hkv = q.shape[1], k.shape[1]
    do = fold_queries(dout, hkv)  # (B, Hkv, G*Nq, dv)
    dq = dk = dv = ds = None
    if need_dv:
        dv = ops.value_gradient(p, do)
    if need_dq or need_dk or need_ds:
        ds = ops.softmax_backward_(p, ops.probability_gradient(do, v))  # (B, Hkv, G*Nq, Nk)
        if need_dq or need_dk:
            dq, dk = ops.query_key_gradients(ds, fold_queries(q, hkv), k, scale)
            dq = unfold_queries(dq, hq)
        ds = unfold_queries(ds, hq)
    return dq, dk, dv, ds


class ExplicitAttention(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    ``bias`` is ``mask.bias`` passed again as a tensor argument so that
    autograd routes its gradient; it returns [Bm, Hm, Nqm, Nkm] like the bias.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        mask: Mask,
        scale: float,
    ) -> torch.Tensor:
        o, p = explicit_forward(q, k, v, mask.with_bias(bias), scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale  # type: ignore[attr-defined]
        ctx.bias_shape = None if bias is None else bias.shape  # type: ignore[attr-defined]
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, p = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        dq, dk, dv, ds = explicit_backward(dout, q, k, v, p, ctx.scale, needs[:4])  # type: ignore[attr-defined]
        dbias = ds.sum_to_size(ctx.bias_shape) if needs[3] else None  # type: ignore[attr-defined]
        return dq, dk, dv, dbias, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return ExplicitAttention.apply(q, k, v, mask.bias, mask, scale)  # type: ignore[no-any-return]
