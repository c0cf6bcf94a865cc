"""Strategy "recompute": forward saves q, k, v and lse; backward rebuilds P whole.

Backward recomputes S = scale * q k^T (masked), rebuilds the whole
P = exp(S - lse), then runs the explicit backward on it.  Saved bytes:
b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + l * B*Hq*Nq (l = 4, or 8 for float64),
plus the caller's mask when given.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from attngrad import ops
from attngrad.heads import group_heads
from attngrad.masks import Mask, bias_meta
from attngrad.strategies.explicit import (
    chunks,
    explicit_backward,
    masked_scores,
    output_and_lse,
)
from attngrad.strategies.first_order import first_order_only

__all__ = ["RecomputeAttention", "attention", "rebuild_probabilities"]


def rebuild_probabilities(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """The whole P = exp(S - lse): [B, Hq, Nq, Nk] in the input dtype, like explicit's.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], lse: [B, Hq, Nq].  S comes from
    the same `masked_scores` chunks as in forward, so it is bit for bit the S
    lse was taken from.
    """
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    q5, kc = group_heads(q, hkv), k.to(ops.compute_dtype(q.dtype))
    lse5 = group_heads(lse, hkv)
    p = q.new_zeros(b, hkv, g, nq, nk) if mask.banded else q.new_empty(b, hkv, g, nq, nk)
    for rows, cols in chunks(q, mask):
        s = masked_scores(q5, kc, mask, scale, rows, cols)
        p[:, :, :, rows, cols] = ops.probabilities(s, lse5[..., rows])
    return p.view(b, hq, nq, nk)


class RecomputeAttention(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    Same arguments as `attngrad.strategies.explicit.ExplicitAttention`.
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
        o, lse = output_and_lse(q, k, v, mask.with_tensors(bias, keep), scale)
        ctx.save_for_backward(q, k, v, lse, bias, keep)  # type: ignore[arg-type]
        ctx.mask = mask.with_tensors(None, None)
        ctx.scale = scale
        ctx.bias_meta = bias_meta(bias)
        return o

    @staticmethod
    @first_order_only("recompute")
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, lse, bias, keep = ctx.saved_tensors
        p = rebuild_probabilities(q, k, lse, ctx.mask.with_tensors(bias, keep), ctx.scale)
        meta = ctx.bias_meta if ctx.needs_input_grad[3] else None
        grads = explicit_backward(dout, q, k, v, p, ctx.mask, ctx.scale, ctx.needs_input_grad, meta)
        return (*grads, None, None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return RecomputeAttention.apply(q, k, v, *mask.tensors, mask, scale)
