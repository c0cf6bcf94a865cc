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

from typing import Any, ClassVar, TypeVar

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

    AttentionFunction.apply(q, k, v, bias, keep, plan) -> (O [B, Hq, Nq, dv],
    lse [B, Hq, Nq] in the compute dtype, then the strategy's saved tensors,
    non-differentiable): torch.func saves only inputs and outputs, so what
    backward needs is returned.  ``bias`` and ``keep`` are the mods' tensors
    passed as arguments so that autograd routes the bias gradient
    ([Bm, Hm, Nqm, Nkm], like the bias); ``plan`` is the rest (`Plan`).
    Backward is `AttentionGradients` (itself differentiable: double backward),
    forward mode is `attngrad.autograd.tangent`, and vmap folds the vmapped
    dim into the batch (`attngrad.autograd.batching`).
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
        plan: Plan[Any],
    ) -> tuple[torch.Tensor, ...]:
        o, saved = plan.strategy.forward(plan.problem(q, k, v, bias, keep))
        return (o, lse(saved["stats"]), *(saved[n] for n in plan.names))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, keep, plan = inputs
        o, _, *saved = output
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)
        # the mask when backward masks again; a bias that requires grad also for its gradient
        keeps = plan.strategy.keeps_mods
        kept_bias = bias if keeps or (bias is not None and bias.requires_grad) else None
        needs_o = "o" in plan.strategy.saves(Shapes.of(q, k, v))
        kept = (o if needs_o else None, kept_bias, keep if keeps else None)
        ctx.save_for_backward(q, k, v, *kept, *saved)
        ctx.save_for_forward(q, k, v, o, bias, keep, *saved)
        ctx.plan = plan

    @staticmethod
    @no_autocast
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, *_: object
    ) -> tuple[torch.Tensor | None, ...]:
        if dout is None and dlse is None:
            return (None,) * 6
        q, k, v, o, bias, keep, *saved = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        need = tuple(ctx.needs_input_grad[:4])
        # O is a cache of q, k, v and the mask: the second derivatives are taken through those
        # (`second_order`), so O enters the backward as a constant, not as another path to them
        o = None if o is None else o.detach()
        grads = batching.apply(
            AttentionGradients, dout, dlse, q, k, v, bias, keep, o, *saved, ctx.plan, need
        )
        return (*grads, None, None)

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, bias, keep, *saved = ctx.saved_tensors
        do, dlse = batching.apply(
            tangent.OutputTangent, *tangents[:4], q, k, v, o, bias, keep, *saved, ctx.plan
        )
        return (do, dlse, *(None for _ in saved))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(args[-1].strategy.function, info, in_dims, args)


def differentiable(strategy: Strategy[T], problem: Problem[T]) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hq, Nq, dv], lse [B, Hq, Nq]) of ``problem`` through the strategy's
    `AttentionFunction`, so that autograd records the call (every derivative)."""
    p = problem
    plan = Plan.of(p, strategy)
    # torch's stubs leave Function.apply untyped
    o, lse_, *_ = strategy.function.apply(p.q, p.k, p.v, *p.mods.tensors, plan)  # type: ignore[no-untyped-call]
    return o, lse_
