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

Their arguments, tensors first (so vmap can fold them; see
`attngrad.autograd.batching`), are named once (`attngrad.autograd.layout`)::

    AttentionGradients.apply(*GRADIENTS, plan, need) -> GRADIENTS_OUT
        (dout, dlse, q, k, v, bias, keep, o, *saved, *captured) -> (dq, dk, dv, dbias, *dcaptured)
    SecondOrder.apply(*SECOND, plan, need) -> SECOND_OUT
        (a_q, a_k, a_v, a_bias, *a_captured, <GRADIENTS>)
        -> (grad dout, grad dlse, grad q, grad k, grad v, grad bias, *grad captured)

``plan`` (`attngrad.core.interface.Plan`) is the call's strategy, mods, scale
and tiles, with the names of the saved tensors; ``captured`` are a score
function's captured tensors (`attngrad.core.score_function`), as many as
``plan.n_captured``; ``need`` says which outputs are wanted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from attngrad.autograd import batching
from attngrad.autograd.layout import Args, Layout, roles
from attngrad.autograd.linearized import Terminal
from attngrad.autograd.second_order import accumulators, second_order_of
from attngrad.core.amp import no_autocast
from attngrad.core.interface import Backward, Plan, Problem, Saved, Strategy

__all__ = [
    "GRADIENTS",
    "GRADIENTS_OUT",
    "SECOND",
    "SECOND_OUT",
    "AttentionGradients",
    "SecondOrder",
    "first_order",
    "in_dtypes_of",
]


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

    likes = (q, k, v, bias, *captured)
    grads = accumulators(likes, need, problem.dtype)
    backward = Backward(problem, saved, dout, dlse, grads[:4], grads[4:])  # type: ignore[arg-type]
    strategy.backward_into(backward)
    return in_dtypes_of(grads, likes)


GRADIENTS = Layout(("dout", "dlse", "q", "k", "v", "bias", "keep", "o", "saved", "captured"))
GRADIENTS_OUT = Layout(("q", "k", "v", "bias", "captured"))
SECOND = Layout(("a_q", "a_k", "a_v", "a_bias", "a_captured", *GRADIENTS.names))
SECOND_OUT = Layout(("dout", "dlse", *GRADIENTS_OUT.names))


class AttentionGradients(torch.autograd.Function):
    """(dq, dk, dv, dbias, *dcaptured) of a strategy, differentiable once more (see the
    module docstring)."""

    GRADIENTS_OF_CAPTURED = True

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: bias, keep; captured; {dbias: bias}) positions for vmap."""
        return roles(GRADIENTS, GRADIENTS_OUT, plan)

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        *tensors, plan, need = args
        x = GRADIENTS.split(plan, tuple(tensors))
        return first_order(plan.strategy, x.problem(plan), x.saved_map(plan), x.dout, x.dlse, need)

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
        wants = GRADIENTS.pick(plan, ctx.needs_input_grad[:-2], SECOND_OUT)
        grads = Args()
        if any(c is not None for c in cotangents) and any(wants):
            out = batching.apply(SecondOrder, *cotangents, *tensors, plan, wants)
            grads = SECOND_OUT.split(plan, out)
        return (*GRADIENTS.join(plan, grads), None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tensors, plan, need = ctx.saved_tensors, ctx.plan, ctx.need
        t = GRADIENTS.split(plan, tangents[:-2])
        out: list[torch.Tensor | None] = [None] * len(need)
        if t.dout is not None or t.dlse is not None:
            x = replace(GRADIENTS.split(plan, tensors), dout=t.dout, dlse=t.dlse)
            out = list(batching.apply(AttentionGradients, *GRADIENTS.join(plan, x), plan, need))
        direction = GRADIENTS_OUT.join(plan, t)  # the tangents of q, k, v, bias, *captured
        if any(a is not None for a in direction):
            wanted = (False, False, *need)  # not the gradients of dout and dlse
            second = batching.apply(SecondOrder, *direction, *tensors, plan, wanted)
            more = SECOND_OUT.pick(plan, second, GRADIENTS_OUT)
            out = [
                a if b is None else (b if a is None else a + b)
                for a, b in zip(out, more, strict=True)
            ]
        return tuple(out)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(AttentionGradients, info, in_dims, args)


class SecondOrder(Terminal):
    """Gradients of <a, (dq, dk, dv, dbias, *dcaptured)> w.r.t. (dout, dlse, q, k, v, bias,
    *captured); not differentiable."""

    GRADIENTS_OF_CAPTURED = True
    MISSING = (
        "third derivatives of attention are not implemented: attngrad's gradients can be "
        "differentiated once more (double backward, Hessian-vector products), not twice."
    )

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: a_bias, bias, keep; a_captured and captured; {grad bias: bias})."""
        return roles(SECOND, SECOND_OUT, plan)

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor | None, ...]:
        *tensors, plan, need = args
        x = SECOND.split(plan, tuple(tensors))
        problem = x.problem(plan)
        assert x.dout is not None
        strategy, saved = plan.strategy, x.saved_map(plan)
        grads = second_order_of(strategy, problem, saved, x.direction, x.dout, x.dlse, need)
        m = problem.mods
        likes = (x.dout, x.dlse, problem.q, problem.k, problem.v, m.bias, *m.captured)
        return in_dtypes_of(grads, likes)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(SecondOrder, info, in_dims, args)
