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

    AttentionGradients.apply(dout, dlse, q, k, v, bias, keep, o, *saved, plan, need)
    SecondOrder.apply(g_q, g_k, g_v, g_bias, <the same>, need6)

``plan`` (`attngrad.core.interface.Plan`) is the call's strategy, mods, scale
and tiles, with the names of the saved tensors.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attngrad.autograd import batching
from attngrad.autograd.linearized import Terminal
from attngrad.autograd.second_order import second_order
from attngrad.core.amp import no_autocast
from attngrad.core.interface import Backward, Plan, Problem, Saved, Strategy

__all__ = ["AttentionGradients", "SecondOrder", "first_order", "in_dtypes_of"]


def in_dtypes_of(
    grads: tuple[torch.Tensor | None, ...], likes: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...]:
    """Each gradient in the dtype of the tensor it is the gradient of (None stays None)."""
    return tuple(
        None if g is None or t is None else g.to(t.dtype) for g, t in zip(grads, likes, strict=True)
    )


def first_order(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias) in the input dtypes from the strategy's ``backward_into``;
    None where ``need`` says no."""
    q, k, v, bias = problem.q, problem.k, problem.v, problem.mods.bias
    if dout is None:
        dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def zeros(like: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
        if like is None or not wanted:
            return None
        return torch.zeros(like.shape, dtype=problem.dtype, device=q.device)

    grads = (zeros(q, need[0]), zeros(k, need[1]), zeros(v, need[2]), zeros(bias, need[3]))
    strategy.backward_into(Backward(problem, saved, dout, dlse, grads))
    return in_dtypes_of(grads, (q, k, v, bias))


def _unpack(plan: Plan[Any], tensors: tuple[Any, ...]) -> tuple[Problem[Any], Saved]:
    """The problem and the saved mapping from (q, k, v, bias, keep, o, *saved)."""
    q, k, v, bias, keep, o, *saved = tensors
    return plan.problem(q, k, v, bias, keep), plan.saved(o, tuple(saved))


class AttentionGradients(torch.autograd.Function):
    """(dq, dk, dv, dbias) of a strategy, differentiable once more (see the module docstring)."""

    MASKS = (5, 6)  # bias, keep
    MASK_OUTPUTS: ClassVar[dict[int, int]] = {3: 5}  # dbias is the bias's gradient

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        dout, dlse, *tensors, plan, need = args
        problem, saved = _unpack(plan, tuple(tensors))
        return first_order(plan.strategy, problem, saved, dout, dlse, need)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors, (plan, need) = inputs[:-2], inputs[-2:]
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.set_materialize_grads(False)
        ctx.plan, ctx.need = plan, need

    @staticmethod
    @no_autocast
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        wants = tuple(ctx.needs_input_grad[:6])
        grads = (None,) * 6
        if any(c is not None for c in cotangents) and any(wants):
            grads = batching.apply(SecondOrder, *cotangents, *tensors, ctx.plan, wants)
        return (*grads, *(None for _ in tensors[6:]), None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tensors, plan, need = ctx.saved_tensors, ctx.plan, ctx.need
        t_dout, t_dlse, t_q, t_k, t_v, t_bias = tangents[:6]
        out: list[torch.Tensor | None] = [None] * 4
        if t_dout is not None or t_dlse is not None:
            first = batching.apply(AttentionGradients, t_dout, t_dlse, *tensors[2:], plan, need)
            out = list(first)
        if any(t is not None for t in (t_q, t_k, t_v, t_bias)):
            second = batching.apply(
                SecondOrder, t_q, t_k, t_v, t_bias, *tensors, plan, (False, False, *need)
            )[2:]
            out = [
                a if b is None else (b if a is None else a + b)
                for a, b in zip(out, second, strict=True)
            ]
        return tuple(out)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(AttentionGradients, info, in_dims, args)


class SecondOrder(Terminal):
    """Gradients of <g, (dq, dk, dv, dbias)> w.r.t. (dout, dlse, q, k, v, bias); not differentiable."""

    MASKS = (3, 9, 10)  # g_bias, bias, keep
    MASK_OUTPUTS: ClassVar[dict[int, int]] = {5: 9}  # grad bias
    MISSING = (
        "third derivatives of attention are not implemented: attngrad's gradients can be "
        "differentiated once more (double backward, Hessian-vector products), not twice."
    )

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        g_q, g_k, g_v, g_bias, dout, dlse, *tensors, plan, need = args
        problem, saved = _unpack(plan, tuple(tensors))
        grads = second_order(
            plan.strategy, problem, saved, (g_q, g_k, g_v, g_bias), dout, dlse, need
        )
        return in_dtypes_of(grads, (dout, dlse, problem.q, problem.k, problem.v, problem.mods.bias))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(SecondOrder, info, in_dims, args)
