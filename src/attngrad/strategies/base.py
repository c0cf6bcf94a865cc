"""The interface every strategy module implements, and the one autograd.Function over it.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv] and a `attngrad.core.scores.ScoreMods`, a strategy module ``m`` has:

    m.unavailable_reason(device) -> str | None        why it cannot run here, or None
    m.tiles(shapes, dtype, block_q, block_k) -> tiles  its tile choice (raises on bad sizes)
    m.forward(q, k, v, mask, scale, tiles) -> (O, saved)
        O: [B, Hq, Nq, dv] in the input dtype, a base tensor (callers may edit it);
        saved: {name: tensor}, what backward needs beyond q, k, v, always with
        "stats" [B, Hq, Nq, 2] = (m, log l) (lse comes from it); "o" is O itself
    m.backward_into(grads, dout, dlse, q, k, v, saved, mask, scale, tiles) -> None
        adds this call's gradients into grads = (dq, dk, dv, dbias): accumulators in
        the compute dtype shaped like q, k, v and the bias (views welcome), each
        None when not wanted; dlse [B, Hq, Nq] (or None) is lse's cotangent,
        which joins dS as dlse * P
    m.probabilities(q, k, saved, mask, scale) -> p_tile
        p_tile(rows, cols) -> P's tile [B, Hkv, G*r, c] in the compute dtype (read
        only): the saved P, or rebuilt from the statistics.  Forward mode
        (`attngrad.autograd.tangent`) and the second-order backward
        (`attngrad.autograd.second_order`) walk tiles of it.
    m.saves(shapes) -> {name: (shape, kind)}           the declaration of ``saved``:
        kind "input" is stored in the input dtype, "stats" in the compute dtype
    m.KEEPS_MASK                                       whether backward reads the mask again
    m.TILED                                            whether it takes block_q, block_k
    m.Function                                         its named `AttentionFunction`

`AttentionFunction` saves q, k, v, the strategy's ``saved`` and (when
``KEEPS_MASK``) the caller's mask; its backward is
`attngrad.autograd.gradients.AttentionGradients`, itself differentiable,
so every strategy has double backward, forward mode and vmap.  Each strategy
names a subclass of its own so the autograd graph says which path ran
(``FlashAttentionBackward``); a call's eager route applies it
(`attngrad.call.eager.run`).  `saved_bytes` turns a declaration into bytes:
the one place the saved-memory formula lives.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch.autograd.function import FunctionCtx

from attngrad.autograd import batching, tangent
from attngrad.autograd.gradients import AttentionGradients
from attngrad.core.amp import no_autocast
from attngrad.core.contract import Shapes
from attngrad.core.ops import compute_dtype, lse
from attngrad.core.scores import ScoreMods

__all__ = ["AttentionFunction", "Grads", "saved_bytes"]

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


def _saved_names(impl: ModuleType, shapes: Shapes) -> tuple[str, ...]:
    """The names of what the strategy saves beyond q, k, v and O (which is an output)."""
    return tuple(n for n in impl.saves(shapes) if n != "o")


class AttentionFunction(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    Outputs (O [B, Hq, Nq, dv], lse [B, Hq, Nq] in the compute dtype, then the
    strategy's ``saved`` tensors, non-differentiable): torch.func saves only
    inputs and outputs, so what backward needs is returned.  ``bias`` and
    ``keep`` are ``mask.tensors`` passed as arguments so that autograd routes
    the bias gradient ([Bm, Hm, Nqm, Nkm], like the bias); ``impl`` is the
    strategy module.  Backward is `AttentionGradients` (itself differentiable:
    double backward), forward mode is `attngrad.autograd.tangent`, and
    vmap folds the vmapped dim into the batch (`attngrad.autograd.batching`).
    """

    MASKS = (3, 4)  # bias, keep
    MASK_OUTPUTS: ClassVar[dict[int, int]] = {}

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        mask: ScoreMods,
        scale: float,
        tiles: object,
        impl: ModuleType,
    ) -> tuple[torch.Tensor, ...]:
        o, saved = impl.forward(q, k, v, mask.with_tensors(bias, keep), scale, tiles)
        return (o, lse(saved["stats"]), *(saved[n] for n in _saved_names(impl, Shapes.of(q, k, v))))

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, keep, mask, scale, tiles, impl = inputs
        o, _, *saved = output
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)
        # the mask when backward masks again; a bias that requires grad also for its gradient
        keeps = impl.KEEPS_MASK
        kept_bias = bias if keeps or (bias is not None and bias.requires_grad) else None
        shapes = Shapes.of(q, k, v)
        needs_o = "o" in impl.saves(shapes)
        kept = (o if needs_o else None, kept_bias, keep if keeps else None)
        ctx.save_for_backward(q, k, v, *kept, *saved)  # type: ignore[arg-type]
        ctx.save_for_forward(q, k, v, o, bias, keep, *saved)
        ctx.names = _saved_names(impl, shapes)
        ctx.impl, ctx.mask, ctx.scale, ctx.tiles = impl, mask.with_tensors(None, None), scale, tiles

    @staticmethod
    @no_autocast
    def backward(
        ctx: FunctionCtx, dout: torch.Tensor | None, dlse: torch.Tensor | None, *_: object
    ) -> tuple[torch.Tensor | None, ...]:
        if dout is None and dlse is None:
            return (None,) * 9
        q, k, v, o, bias, keep, *saved = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        need = tuple(ctx.needs_input_grad[:4])
        # O is a cache of q, k, v and the mask: the second derivatives are taken through those
        # (`second_order`), so O enters the backward as a constant, not as another path to them
        o = None if o is None else o.detach()
        grads = batching.apply(
            AttentionGradients, dout, dlse, q, k, v, bias, keep, o, *saved,
            ctx.names, ctx.mask, ctx.scale, ctx.tiles, ctx.impl, need,
        )  # fmt: skip
        return (*grads, None, None, None, None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: FunctionCtx, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, bias, keep, *saved = ctx.saved_tensors
        do, dlse = batching.apply(
            tangent.OutputTangent, *tangents[:4], q, k, v, o, bias, keep, *saved,
            ctx.names, ctx.mask, ctx.scale, ctx.tiles, ctx.impl,
        )  # fmt: skip
        return (do, dlse, *(None for _ in saved))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(args[-1].Function, info, in_dims, args)
