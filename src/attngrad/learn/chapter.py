"""The teaching `CustomAttention` of the course chapter attngrad grows from.

Single head, no mask, no dropout, q/k/v of one shape [B, N, d]; it runs the
"explicit" strategy (saves q, k, v, P) with the chapter's input contract.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attngrad.core.contract import Shapes
from attngrad.core.interface import Backward, Problem
from attngrad.core.ops import compute_dtype
from attngrad.core.scores import ScoreMods
from attngrad.strategies import REGISTRY

__all__ = ["CustomAttention"]

_EXPLICIT = REGISTRY["explicit"]  # the strategy it runs, taken from the registry


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be 3-D [batch, seq_len, head_dim] tensors, got {shapes}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k, v must share batch and seq_len, got {shapes}")
    if q.size(-1) != k.size(-1) or v.size(-1) != q.size(-1):
        raise ValueError(f"q, k, v must share head_dim, got {shapes}")
    if q.device != k.device or k.device != v.device:
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; "
            "move them with .to(q.device)"
        )
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise TypeError(
            f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "convert them with .float()"
        )
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(
            f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them with .to(q.dtype)"
        )


class CustomAttention(torch.autograd.Function):
    """Scaled-dot-product attention with a hand-written backward.

    q, k, v: [B, N, d] of one dtype and device -> O: [B, N, d].

    >>> q = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    >>> CustomAttention.apply(q, q, q).shape
    torch.Size([1, 3, 4])
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _check(q, k, v)
        scale = 1.0 / math.sqrt(q.size(-1))
        mods = ScoreMods.none(heads_kv=1, seq_q=q.shape[1], seq_k=k.shape[1])
        q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, N, d)
        rows = _EXPLICIT.tiles(Shapes.of(q4, k4, v4), q.dtype, None, None)
        o, saved = _EXPLICIT.forward(Problem(q4, k4, v4, mods, scale, rows))
        ctx.save_for_backward(q, k, v, saved["p"])
        ctx.scale, ctx.rows = scale, rows
        return o.squeeze(1)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        if dout.shape != q.shape:
            raise ValueError(
                f"dout must have the output's shape {tuple(q.shape)}, got {tuple(dout.shape)}"
            )
        mods = ScoreMods.none(heads_kv=1, seq_q=q.shape[1], seq_k=k.shape[1])
        q, k, v, dout = (t.unsqueeze(1) for t in (q, k, v, dout))  # (B, 1, N, d)
        dq, dk, dv = (
            torch.zeros_like(t, dtype=compute_dtype(t.dtype)) if need else None
            for t, need in zip((q, k, v), ctx.needs_input_grad, strict=True)
        )
        with torch.no_grad():  # the hand-written backward is not itself differentiated
            problem = Problem(q, k, v, mods, ctx.scale, ctx.rows)
            _EXPLICIT.backward_into(Backward(problem, {"p": p}, dout, None, (dq, dk, dv, None)))
        return tuple(None if g is None else g.squeeze(1).to(q.dtype) for g in (dq, dk, dv))
