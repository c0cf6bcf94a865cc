"""The backward of every strategy as differentiable Functions.

`AttentionGradients` is the first-order backward of
`attngrad.strategies.base.AttentionFunction`: its forward runs the strategy's
``backward_into`` (dq, dk, dv, dbias from dO and dlse), its backward is
`SecondOrder` (the tiled second derivatives of
`attngrad.autograd.second_order`), so ``create_graph=True`` and a second
backward work on every strategy at the strategy's memory cost.  Its jvp
(what ``torch.func.hessian`` = jacfwd(jacrev) needs) follows from the same
pieces: the gradients B(x; c) = J(x)^T c are linear in the cotangent c and
their derivative in x is the Hessian of <c, f>, symmetric, so

    B'(x; c) = B(x; c') + H_c x'

is the first-order backward on the cotangents' tangents plus `SecondOrder`
with the inputs' tangents as its cotangents.  Third derivatives raise.

Argument layout (tensors first, so vmap can fold them; see
`attngrad.autograd.batching`)::

    AttentionGradients.apply(dout, dlse, q, k, v, bias, keep, o, *saved,
                             names, mask, scale, tiles, impl, need)
    SecondOrder.apply(g_q, g_k, g_v, g_bias, <the same>, need6)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch
from torch.autograd.function import FunctionCtx

from attngrad.autograd import batching
from attngrad.autograd.second_order import second_order
from attngrad.core.amp import no_autocast
from attngrad.core.ops import compute_dtype
from attngrad.core.scores import ScoreMods

__all__ = ["AttentionGradients", "SecondOrder", "saved_dict"]


def saved_dict(
    o: torch.Tensor | None, names: tuple[str, ...], saved: tuple[torch.Tensor, ...]
) -> dict[str, torch.Tensor]:
    """The strategy's ``saved`` mapping, with the forward's O as "o" when kept."""
    out = dict(zip(names, saved, strict=True))
    if o is not None:
        out["o"] = o
    return out


def first_order(
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    saved: dict[str, torch.Tensor],
    mask: ScoreMods,
    scale: float,
    tiles: object,
    impl: ModuleType,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias) in the input dtypes from ``impl.backward_into``; None where not needed."""
    dtype = compute_dtype(q.dtype)
    if dout is None:
        dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def zeros(like: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
        if like is None or not wanted:
            return None
        return torch.zeros(like.shape, dtype=dtype, device=q.device)

    grads = (zeros(q, need[0]), zeros(k, need[1]), zeros(v, need[2]), zeros(bias, need[3]))
    impl.backward_into(
        grads, dout, dlse, q, k, v, saved, mask.with_tensors(bias, keep), scale, tiles
    )
    likes = (q, k, v, bias)
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, likes, strict=True))  # type: ignore[union-attr]


class AttentionGradients(torch.autograd.Function):
    """(dq, dk, dv, dbias) of a strategy, differentiable once more (see the module docstring)."""

    MASKS = (5, 6)  # bias, keep
    MASK_OUTPUTS: ClassVar[dict[int, int]] = {3: 5}  # dbias is the bias's gradient

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        dout, dlse, q, k, v, bias, keep, o, *rest = args
        *saved, names, mask, scale, tiles, impl, need = rest
        return first_order(
            dout, dlse, q, k, v, bias, keep, saved_dict(o, names, tuple(saved)),
            mask, scale, tiles, impl, need,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        tensors, (names, mask, scale, tiles, impl, need) = inputs[:-6], inputs[-6:]
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.set_materialize_grads(False)
        ctx.options = (names, mask, scale, tiles, impl, need)

    @staticmethod
    @no_autocast
    def backward(
        ctx: FunctionCtx, *cotangents: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        names, mask, scale, tiles, impl, _ = ctx.options
        wants = tuple(ctx.needs_input_grad[:6])
        grads = (None,) * 6
        if any(c is not None for c in cotangents) and any(wants):
            grads = batching.apply(
                SecondOrder, *cotangents, *tensors, names, mask, scale, tiles, impl, wants
            )
        return (*grads, *(None for _ in tensors[6:]), None, None, None, None, None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: FunctionCtx, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        names, mask, scale, tiles, impl, need = ctx.options
        t_dout, t_dlse, t_q, t_k, t_v, t_bias = tangents[:6]
        out: list[torch.Tensor | None] = [None] * 4
        if t_dout is not None or t_dlse is not None:
            first = batching.apply(
                AttentionGradients, t_dout, t_dlse, *tensors[2:], names, mask, scale, tiles,
                impl, need,
            )  # fmt: skip
            out = list(first)
        if any(t is not None for t in (t_q, t_k, t_v, t_bias)):
            second = batching.apply(
                SecondOrder, t_q, t_k, t_v, t_bias, *tensors, names, mask, scale, tiles, impl,
                (False, False, *need),
            )[2:]  # fmt: skip
            out = [
                a if b is None else (b if a is None else a + b)
                for a, b in zip(out, second, strict=True)
            ]
        return tuple(out)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(AttentionGradients, info, in_dims, args)


class SecondOrder(torch.autograd.Function):
    """Gradients of <g, (dq, dk, dv, dbias)> w.r.t. (dout, dlse, q, k, v, bias); not differentiable."""

    MASKS = (3, 9, 10)  # g_bias, bias, keep
    MASK_OUTPUTS: ClassVar[dict[int, int]] = {5: 9}  # grad bias

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        g_q, g_k, g_v, g_bias, dout, dlse, q, k, v, bias, keep, o, *rest = args
        *saved, names, mask, scale, tiles, impl, need = rest
        grads = second_order(
            impl, (g_q, g_k, g_v, g_bias), dout, dlse, q, k, v,
            saved_dict(o, names, tuple(saved)), mask.with_tensors(bias, keep), scale, tiles, need,
        )  # fmt: skip
        likes = (dout, dlse, q, k, v, bias)
        return tuple(
            None if g is None else g.to(t.dtype) for g, t in zip(grads, likes, strict=True)
        )  # type: ignore[union-attr]

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Any) -> tuple[None, ...]:
        raise NotImplementedError(
            "third derivatives of attention are not implemented: attngrad's gradients can be "
            "differentiated once more (double backward, Hessian-vector products), not twice."
        )

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(SecondOrder, info, in_dims, args)
