"""Strategy "recompute": forward saves q, k, v and the row statistics; backward rebuilds P.

Backward recomputes S = scale * q k^T (masked) and P = exp((S - m) - log l) one chunk
of query rows at a time, in the chunks explicit's backward walks, and runs
explicit's backward ops on each chunk as it is rebuilt: the whole P is never
held, so the rebuilt chunk is still in cache when the backward matmuls read it.
Saved bytes: b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + 2 * l * B*Hq*Nq for
stats = (m, log l) (l = 4, or 8 for float64; see `attngrad.ops` for why not
lse alone), plus the caller's mask when given.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from attngrad import ops
from attngrad.heads import group_heads
from attngrad.masks import Mask, bias_meta
from attngrad.strategies.explicit import (
    ProbabilityChunks,
    explicit_backward,
    masked_scores,
    output_and_stats,
)
from attngrad.strategies.first_order import first_order_only

__all__ = ["RecomputeAttention", "attention", "rebuilt_probabilities"]


def rebuilt_probabilities(
    q: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, mask: Mask, scale: float
) -> ProbabilityChunks:
    """Chunks of P = exp((S - m) - log l), rebuilt on demand, for `explicit_backward`.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], stats: [B, Hq, Nq, 2].  S comes
    from the same `masked_scores` chunks as in forward, so it is bit for bit
    the S the statistics were taken from.
    """
    hkv = k.shape[1]
    q5, kc = group_heads(q, hkv), k.to(ops.compute_dtype(q.dtype))
    stats5 = group_heads(stats, hkv)  # (B, Hkv, G, Nq, 2)

    def p_chunk(rows: slice, cols: slice) -> torch.Tensor:
        s = masked_scores(q5, kc, mask, scale, rows, cols)  # (B, Hkv, G, r, c)
        return ops.probabilities_(s, stats5[:, :, :, rows]).flatten(2, 3)

    return p_chunk


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
        o, stats = output_and_stats(q, k, v, mask.with_tensors(bias, keep), scale)
        ctx.save_for_backward(q, k, v, stats, bias, keep)  # type: ignore[arg-type]
        ctx.mask = mask.with_tensors(None, None)
        ctx.scale = scale
        ctx.bias_meta = bias_meta(bias)
        return o

    @staticmethod
    @first_order_only("recompute")
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, stats, bias, keep = ctx.saved_tensors
        mask = ctx.mask.with_tensors(bias, keep)
        p_chunk = rebuilt_probabilities(q, k, stats, mask, ctx.scale)
        meta = ctx.bias_meta if ctx.needs_input_grad[3] else None
        grads = explicit_backward(
            dout, q, k, v, p_chunk, mask, ctx.scale, ctx.needs_input_grad, meta
        )
        return (*grads, None, None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return RecomputeAttention.apply(q, k, v, *mask.tensors, mask, scale)
