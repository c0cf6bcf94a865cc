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
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

from attngrad.autograd import batching, tangent
from attngrad.autograd.gradients import AttentionGradients
from attngrad.core.amp import no_autocast
from attngrad.core.contract import Shapes
from attngrad.core.interface import Plan, Problem, Strategy
from attngrad.core.ops import lse

__all__ = ["AttentionFunction", "ForwardTangentFunction", "differentiable", "forward_tangents"]

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
        need = (*ctx.needs_input_grad[:4], *ctx.needs_input_grad[6 : 6 + n])
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


class ForwardTangentFunction(AttentionFunction):
    """`AttentionFunction` with forward mode in the same pass as the forward.

    ForwardTangentFunction.apply(q, k, v, bias, keep, plan, *captured, q', k', v', bias',
    *captured') -> AttentionFunction's outputs, then (O', lse') (non-differentiable): the
    tangents, read before the call (`forward_tangents`), go in as inputs, the strategy's
    `forward_tangent` computes O and O' together, and jvp returns the O' and lse' it made.
    Backward, double backward and the saved tensors are AttentionFunction's (the pass's O
    and statistics are the plain forward's).
    """

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """AttentionFunction's, bias' a mask too, and the captured tensors' tangents shared by
        the whole call as the captured tensors are."""
        n = plan.n_captured
        first = 6 + n  # q'
        return (3, 4, first + 3), (*range(6, first), *range(first + 4, first + 4 + n)), {}

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        q, k, v, bias, keep, plan, *rest = args
        count = plan.n_captured
        captured, dirs = tuple(rest[:count]), tuple(rest[count:])
        problem = plan.problem(q, k, v, bias, keep, captured)
        result = plan.strategy.forward_tangent(problem, dirs)
        assert result is not None  # `differentiable` asked first
        o, saved, do, dlse = result
        return (o, lse(saved["stats"]), *(saved[n] for n in plan.names), do, dlse)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        primals = 6 + inputs[5].n_captured  # q, k, v, bias, keep, plan, *captured
        AttentionFunction.setup_context(ctx, inputs[:primals], output[:-2])
        do, dlse = output[-2:]
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_forward(*ctx.saved_for_forward, do, dlse)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        tangents = 4 + ctx.plan.n_captured  # q', k', v', bias', *captured': no gradient
        return (*AttentionFunction.backward(ctx, *grads[:-2]), *(None,) * tangents)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # `forward_tangents` let the call in under exactly one forward-mode level, so the
        # tangents of q, k, v, bias and the captured tensors here are the ones the pass
        # took; those of the tangent inputs (torch.func hands wrapped zeros) move no output
        do, dlse = ctx.saved_tensors[-2:]
        return (do, dlse, *(None for _ in ctx.plan.names), None, None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        function = args[5].strategy.tangent_function
        return batching.vmap_rule(function, info, in_dims, args)


def forward_tangents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
    captured: list[torch.Tensor | None],
) -> tuple[torch.Tensor | None, ...] | None:  # fmt: skip
    """The forward-mode tangents (q', k', v', bias', *captured') of a call about to be
    applied, when exactly one forward-mode level is active here (a forward_ad dual level, or
    one torch.func.jvp level with vmaps outside it: jacfwd; nothing else, so no tangent
    carries a tangent of its own), not compiling, and no tangent needs a gradient; else None
    (also when none moves q, k, v, bias or a captured tensor).  Then
    `ForwardTangentFunction` may compute O' with O."""
    if torch.compiler.is_compiling():  # torch.compile never sees the one pass
        return None
    interpreters = retrieve_all_functorch_interpreters()
    dual = forward_ad._current_level >= 0
    if not interpreters and not dual:
        return None
    if interpreters:
        kinds = [i.key() for i in interpreters]
        # torch.func.jvp runs under a dual level of its own, the one its interpreter names
        if kinds[-1] != TransformType.Jvp or kinds.count(TransformType.Jvp) != 1:
            return None
        if any(x not in (TransformType.Jvp, TransformType.Vmap) for x in kinds):
            return None
    dirs = tuple(_tangent(t) for t in (q, k, v, bias, *captured))
    if all(t is None for t in dirs):
        return None
    # a tangent with a gradient, or batched by the legacy vmap (gradcheck's batched forward
    # grad): the two-pass way
    if any(t is not None and (t.requires_grad or _legacy_batched(t)) for t in dirs):
        return None
    return dirs


def _tangent(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s forward-mode tangent at the current level, or None."""
    if t is None:
        return None
    tangent_: torch.Tensor | None = forward_ad.unpack_dual(t).tangent  # type: ignore[no-untyped-call]
    return tangent_


def _legacy_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a BatchedTensor of torch's legacy vmap (``torch._vmap_internals``)."""
    return bool(torch._C._functorch.is_legacy_batchedtensor(t))  # type: ignore[attr-defined]


def differentiable(
    strategy: Strategy[T], problem: Problem[T]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O [B, Hq, Nq, dv], lse [B, Hq, Nq], stats [B, Hq, Nq, 2]) of ``problem`` through the
    strategy's `AttentionFunction`, so that autograd records the call (every derivative);
    stats = (m, log l), every strategy's, not differentiable."""
    p = problem
    plan = Plan.of(p, strategy)
    bias, keep, *captured = p.mods.tensors
    one_pass = strategy.tangent_function
    dirs = None if one_pass is None else forward_tangents(p.q, p.k, p.v, bias, captured)
    if dirs is not None and strategy.one_pass_tangent(p, dirs):
        assert one_pass is not None
        o, lse_, *saved = one_pass.apply(p.q, p.k, p.v, bias, keep, plan, *captured, *dirs)  # type: ignore[no-untyped-call]
        return o, lse_, saved[plan.names.index("stats")]
    # torch's stubs leave Function.apply untyped
    o, lse_, *saved = strategy.function.apply(p.q, p.k, p.v, bias, keep, plan, *captured)  # type: ignore[no-untyped-call]
    return o, lse_, saved[plan.names.index("stats")]
