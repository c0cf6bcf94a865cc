"""The interface every strategy module implements, and the one autograd.Function over it.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv] and a `attngrad.masks.Mask`, a strategy module ``m`` has:

    m.unavailable_reason(device) -> str | None        why it cannot run here, or None
    m.tiles(shapes, dtype, block_q, block_k) -> tiles  its tile choice (raises on bad sizes)
    m.forward(q, k, v, mask, scale, tiles) -> (O, saved)
        O: [B, Hq, Nq, dv] in the input dtype, a base tensor (callers may edit it);
        saved: {name: tensor}, what backward needs beyond q, k, v
    m.backward_into(grads, dout, q, k, v, saved, mask, scale, tiles) -> None
        adds this call's gradients into grads = (dq, dk, dv, dbias): accumulators in
        the compute dtype shaped like q, k, v and the bias (views welcome), each
        None when not wanted
    m.saves(shapes) -> {name: (shape, kind)}           the declaration of ``saved``:
        kind "input" is stored in the input dtype, "stats" in the compute dtype
    m.KEEPS_MASK                                       whether backward reads the mask again
    m.Function                                         its named `AttentionFunction`

`AttentionFunction` saves q, k, v, the strategy's ``saved`` and (when
``KEEPS_MASK``) the caller's mask, and runs ``backward_into`` on fresh
accumulators.  Each strategy names a subclass of its own so the autograd
graph says which path ran (``FlashAttentionBackward``).  `saved_bytes` turns
a declaration into bytes: the one place the saved-memory formula lives.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch.autograd.function import FunctionCtx

from attngrad.contract import Shapes
from attngrad.masks import Mask
from attngrad.ops import compute_dtype
from attngrad.strategies.first_order import refuse_double_backward

__all__ = ["AttentionFunction", "Grads", "attention", "saved_bytes"]

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def saved_bytes(impl: ModuleType, shapes: Shapes, dtype: torch.dtype, mask_bytes: int = 0) -> int:
    """Bytes a call of strategy ``impl`` keeps from forward to backward.

    q, k, v in the input dtype, then the module's declaration (`saves`), then
    the caller's mask (``mask_bytes``) when the strategy keeps it.
    """
    b, stat = torch.finfo(dtype).bits // 8, torch.finfo(compute_dtype(dtype)).bits // 8
    sh = shapes
    total = b * sh.batch * (sh.heads_q * sh.seq_q * sh.head_dim)
    total += b * sh.batch * sh.heads_kv * sh.seq_k * (sh.head_dim + sh.value_dim)
    for shape, kind in impl.saves(shapes).values():
        total += math.prod(shape) * (b if kind == "input" else stat)
    return total + (mask_bytes if impl.KEEPS_MASK else 0)


class AttentionFunction(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    ``bias`` and ``keep`` are ``mask.tensors`` passed as arguments so that
    autograd routes the bias gradient ([Bm, Hm, Nqm, Nkm], like the bias);
    ``impl`` is the strategy module.
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
        tiles: object,
        impl: ModuleType,
    ) -> torch.Tensor:
        o, saved = impl.forward(q, k, v, mask.with_tensors(bias, keep), scale, tiles)
        kept = (bias, keep) if impl.KEEPS_MASK else (None, None)
        ctx.save_for_backward(q, k, v, *saved.values(), *kept)  # type: ignore[arg-type]
        ctx.names, ctx.impl = tuple(saved), impl
        ctx.band, ctx.scale, ctx.tiles = mask.with_tensors(None, None), scale, tiles
        ctx.bias_shape = None if bias is None else bias.shape
        return o

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward(ctx.impl.__name__.rsplit(".", 1)[-1])
        q, k, v, *rest = ctx.saved_tensors
        n = len(ctx.names)
        saved, (bias, keep) = dict(zip(ctx.names, rest[:n], strict=True)), rest[n:]
        dtype = compute_dtype(q.dtype)
        need = ctx.needs_input_grad

        def zeros(like: torch.Tensor | torch.Size | None, wanted: bool) -> torch.Tensor | None:
            if like is None or not wanted:
                return None
            shape = like.shape if isinstance(like, torch.Tensor) else like
            return torch.zeros(shape, dtype=dtype, device=q.device)

        grads = (zeros(q, need[0]), zeros(k, need[1]), zeros(v, need[2]))
        dbias = zeros(ctx.bias_shape, need[3])
        mask = ctx.band.with_tensors(bias, keep)
        ctx.impl.backward_into((*grads, dbias), dout, q, k, v, saved, mask, ctx.scale, ctx.tiles)
        dq, dk, dv = (None if g is None else g.to(q.dtype) for g in grads)
        return (
            dq,
            dk,
            dv,
            None if dbias is None else dbias.to(q.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def attention(
    impl: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] of strategy ``impl`` for q: [B, Hq, Nq, d], k, v: [B, Hkv, Nk, d | dv].

    RuntimeError when the strategy cannot run on these tensors here.
    """
    reason = impl.unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    tiles = impl.tiles(Shapes.of(q, k, v), q.dtype, block_q, block_k)
    return impl.Function.apply(q, k, v, *mask.tensors, mask, scale, tiles, impl)
