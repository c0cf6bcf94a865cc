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

    AttentionGradients.apply(dout, dlse, q, k, v, bias, keep, o, *saved, *captured, plan, need)
        -> (dq, dk, dv, dbias, *dcaptured)
    SecondOrder.apply(g_q, g_k, g_v, g_bias, *g_captured, <the same>, need)
        -> (grad dout, grad dlse, grad q, grad k, grad v, grad bias, *grad captured)

``plan`` (`attngrad.core.interface.Plan`) is the call's strategy, mods, scale
and tiles, with the names of the saved tensors; ``captured`` are a score
function's captured tensors (`attngrad.core.score_function`), as many as
``plan.n_captured``.
"""

from __future__ import annotations

from typing import Any

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
    """(dq, dk, dv, dbias, *dcaptured) in the input dtypes from the strategy's
    ``backward_into``; None where ``need`` says no."""
    q, k, v, bias = problem.q, problem.k, problem.v, problem.mods.bias
    captured = problem.mods.captured
    if dout is None:
        dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def zeros(like: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
        if like is None or not wanted or not like.is_floating_point():
            return None
        dtype = torch.promote_types(like.dtype, problem.dtype)
        return torch.zeros(like.shape, dtype=dtype, device=like.device)

    likes = (q, k, v, bias, *captured)
    grads = tuple(zeros(t, n) for t, n in zip(likes, need, strict=True))
    backward = Backward(problem, saved, dout, dlse, grads[:4], grads[4:])  # type: ignore[arg-type]
    strategy.backward_into(backward)
    return in_dtypes_of(grads, likes)


def _unpack(plan: Plan[Any], tensors: tuple[Any, ...]) -> tuple[Problem[Any], Saved]:
    """The problem and the saved mapping from (q, k, v, bias, keep, o, *saved, *captured)."""
    q, k, v, bias, keep, o, *rest = tensors
    n = len(plan.names)
    return plan.problem(q, k, v, bias, keep, tuple(rest[n:])), plan.saved(o, tuple(rest[:n]))


class AttentionGradients(torch.autograd.Function):
    """(dq, dk, dv, dbias, *dcaptured) of a strategy, differentiable once more (see the
    module docstring)."""

    GRADIENTS_OF_CAPTURED = True

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: bias, keep; captured; {dbias: bias}) positions for vmap."""
        first = 8 + len(plan.names)
        return (5, 6), tuple(range(first, first + plan.n_captured)), {3: 5}

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
        tensors, plan = ctx.saved_tensors, ctx.plan
        n, first = plan.n_captured, 8 + len(plan.names)
        wants = (*ctx.needs_input_grad[:6], *ctx.needs_input_grad[first : first + n])
        grads: tuple[torch.Tensor | None, ...] = (None,) * (6 + n)
        if any(c is not None for c in cotangents) and any(wants):
            grads = batching.apply(SecondOrder, *cotangents, *tensors, plan, wants)
        middle = (None for _ in tensors[6:first])  # keep, o, saved
        return (*grads[:6], *middle, *grads[6:], None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tensors, plan, need = ctx.saved_tensors, ctx.plan, ctx.need
        n, first = plan.n_captured, 8 + len(plan.names)
        t_dout, t_dlse, t_q, t_k, t_v, t_bias = tangents[:6]
        t_captured = tangents[first : first + n]
        out: list[torch.Tensor | None] = [None] * (4 + n)
        if t_dout is not None or t_dlse is not None:
            first_part = batching.apply(
                AttentionGradients, t_dout, t_dlse, *tensors[2:], plan, need
            )
            out = list(first_part)
        direction = (t_q, t_k, t_v, t_bias, *t_captured)
        if any(t is not None for t in direction):
            second = batching.apply(SecondOrder, *direction, *tensors, plan, (False, False, *need))[
                2:
            ]
            out = [
                a if b is None else (b if a is None else a + b)
                for a, b in zip(out, second, strict=True)
            ]
        return tuple(out)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(AttentionGradients, info, in_dims, args)


class SecondOrder(Terminal):
    """Gradients of <g, (dq, dk, dv, dbias, *dcaptured)> w.r.t. (dout, dlse, q, k, v, bias,
    *captured); not differentiable."""

    GRADIENTS_OF_CAPTURED = True
    MISSING = (
        "third derivatives of attention are not implemented: attngrad's gradients can be "
        "differentiated once more (double backward, Hessian-vector products), not twice."
    )

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: g_bias, bias, keep; g_captured and captured; {grad bias: bias})."""
        n = plan.n_captured
        bias = 4 + n + 5
        last = bias + 3 + len(plan.names)  # after keep, o, saved
        captured = (*range(4, 4 + n), *range(last, last + n))
        return (3, bias, bias + 1), captured, {5: bias}

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        *tensors, plan, need = args
        n = plan.n_captured
        g_q, g_k, g_v, g_bias = tensors[:4]
        g_captured = tuple(tensors[4 : 4 + n])
        dout, dlse, *rest = tensors[4 + n :]
        problem, saved = _unpack(plan, tuple(rest))
        grads = second_order(
            plan.strategy, problem, saved, (g_q, g_k, g_v, g_bias, *g_captured), dout, dlse, need
        )
        m = problem.mods
        likes = (dout, dlse, problem.q, problem.k, problem.v, m.bias, *m.captured)
        return in_dtypes_of(grads, likes)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(SecondOrder, info, in_dims, args)
