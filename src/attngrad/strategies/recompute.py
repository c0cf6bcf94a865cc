"""Strategy "recompute": forward saves q, k, v and lse; backward rebuilds P whole.

Backward recomputes S = scale * q k^T (masked), P = exp(S - lse), then runs
the explicit backward ops on it.  Saved bytes: b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv))
+ l * B*Hq*Nq (l = 4, or 8 for float64), plus the caller's mask when given.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from attngrad import ops
from attngrad.masks import Mask
from attngrad.strategies.explicit import (
    bias_gradient,
    explicit_backward,
    explicit_forward,
    masked_scores,
)

__all__ = ["RecomputeAttention", "attention"]


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
        o, _, lse = explicit_forward(q, k, v, mask.with_tensors(bias, keep), scale)
        ctx.save_for_backward(q, k, v, lse, bias, keep)  # type: ignore[arg-type]
        ctx.mask = mask.with_tensors(None, None)
        ctx.scale = scale
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, lse, bias, keep = ctx.saved_tensors
        mask = ctx.mask.with_tensors(bias, keep)
        # the same masked_scores call as forward: S is bit for bit the one lse came from
        p = ops.probabilities(masked_scores(q, k, mask, ctx.scale), lse)
        needs = ctx.needs_input_grad[:4]
        dq, dk, dv, ds = explicit_backward(dout, q, k, v, p, ctx.scale, needs)
        return dq, dk, dv, bias_gradient(ds, ctx.bias_meta), None, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return RecomputeAttention.apply(q, k, v, *mask.tensors, mask, scale)
