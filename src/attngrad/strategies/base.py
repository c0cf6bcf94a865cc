"""The one autograd.Function over every strategy (`attngrad.core.interface`).

`AttentionFunction` saves q, k, v, the strategy's ``saved`` and (when
``keeps_mods``) the caller's mask; its backward is
`attngrad.autograd.gradients.AttentionGradients`, itself differentiable, so
every strategy has double backward, forward mode and vmap.  Each strategy
names a subclass of its own so the autograd graph says which path ran
(``FlashAttentionBackward``); a call's eager route applies it
(`attngrad.call.eager.run`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from attngrad.autograd import batching, tangent
from attngrad.autograd.gradients import AttentionGradients
from attngrad.core.amp import no_autocast
from attngrad.core.contract import Shapes
from attngrad.core.interface import Plan, Problem, Strategy
from attngrad.core.ops import lse

__all__ = ["AttentionFunction", "differentiable"]

T = TypeVar("T")


class AttentionFunction(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    AttentionFunction.apply(q, k, v, bias, keep, plan, *captured) -> (O [B, Hq, Nq, dv],
    lse [B, Hq, Nq] in the compute dtype, then the strategy's saved tensors,
    non-differentiable): torch.func saves only inputs and outputs, so what
    backward needs is returned.  ``bias``, ``keep`` and the score function's
    ``captured`` tensors are the mods' tensors passed as arguments so that
    autograd routes their gradients (the bias's [Bm, Hm, Nqm, Nkm], like the
    bias); ``plan`` is the rest (`Plan`).  Backward is `AttentionGradients`
    (itself differentiable: double backward), forward mode is
    `attngrad.autograd.tangent`, and vmap folds the vmapped dim into the batch
    (`attngrad.autograd.batching`).
    """

    GRADIENTS_OF_CAPTURED = False

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: bias, keep; captured; mask outputs) positions for vmap."""
        return (3, 4), tuple(range(6, 6 + plan.n_captured)), {}

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        plan: Plan[Any],
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        o, saved = plan.strategy.forward(plan.problem(q, k, v, bias, keep, captured))
        return (o, lse(saved["stats"]), *(saved[n] for n in plan.names))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, keep, plan, *captured = inputs
        o, _, *saved = output
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)
        # the mask when backward masks again; a bias that requires grad also for its gradient
        keeps = plan.strategy.keeps_mods
        kept_bias = bias if keeps or (bias is not None and bias.requires_grad) else None
        needs_o = "o" in plan.strategy.saves(Shapes.of(q, k, v))
        kept = (o if needs_o else None, kept_bias, keep if keeps else None)
        ctx.save_for_backward(q, k, v, *kept, *saved, *captured)
        ctx.save_for_forward(q, k, v, o, bias, keep, *saved, *captured)
        ctx.plan = plan

    @staticmethod
    @no_autocast
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, *_: object
    ) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        n: int = plan.n_captured
        if dout is None and dlse is None:
            return (None,) * (6 + n)
        q, k, v, o, bias, keep, *rest = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        need = (*ctx.needs_input_grad[:4], *ctx.needs_input_grad[6:])
        # O is a cache of q, k, v and the mask: the second derivatives are taken through those
        # (`second_order`), so O enters the backward as a constant, not as another path to them
        o = None if o is None else o.detach()
        grads = batching.apply(
            AttentionGradients, dout, dlse, q, k, v, bias, keep, o, *rest, plan, need
        )
        return (*grads[:4], None, None, *grads[4:])

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        q, k, v, o, bias, keep, *rest = ctx.saved_tensors
        n_saved = len(plan.names)
        t_captured = tangents[6 : 6 + plan.n_captured]
        do, dlse = batching.apply(
            tangent.OutputTangent, *tangents[:4], *t_captured, q, k, v, o, bias, keep, *rest, plan
        )
        return (do, dlse, *(None for _ in range(n_saved)))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(args[5].strategy.function, info, in_dims, args)


def differentiable(
    strategy: Strategy[T], problem: Problem[T]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O [B, Hq, Nq, dv], lse [B, Hq, Nq], stats [B, Hq, Nq, 2]) of ``problem`` through the
    strategy's `AttentionFunction`, so that autograd records the call (every derivative);
    stats = (m, log l), every strategy's, not differentiable."""
    p = problem
    plan = Plan.of(p, strategy)
    bias, keep, *captured = p.mods.tensors
    # torch's stubs leave Function.apply untyped
    o, lse_, *saved = strategy.function.apply(p.q, p.k, p.v, bias, keep, plan, *captured)  # type: ignore[no-untyped-call]
    return o, lse_, saved[plan.names.index("stats")]
