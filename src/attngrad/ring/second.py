r"""Ring attention's second derivatives at O(N/P) per rank: the second-order pass around the ring.

For the cotangents g = (g_q, g_k, g_v, g_bias, *g_captured) of the first-order
gradients, the second-order pass (`attngrad.autograd.second_order`, which has the
derivation) needs four sums per query row over every key before any tile's
gradient: Delta = rowsum(P dP), r = rowsum(P G), rowsum(P G dP) and
rowsum(dO * P g_v).  Each adds up over key blocks, and with the rows' final
statistics each block's P = exp(S - lse) is already the softmax over every key,
so the pass is two rings:

1. k, v and, where some rank has them, g_k and g_v travel (`circulate`); each
   pair's block kernel returns its keys' share of the row sums
   (`attngrad.autograd.second_order.sums_of`), summed into this rank's rows.
2. They travel again with accumulators for grad k and grad v (`carry_home`, as
   the first-order backward's dK and dV); each pair's second-order pass, given
   the sums over every key, adds its share of grad dO, grad q and the mask's and
   the score_mod's tensors' gradients into this rank's, and of grad k and grad v
   into the travelling accumulators.  grad dlse = r.

A rank holds its shards, the shards in hand and in flight and one set of
accumulators, and each pair's kernel its own tiles: O(N/P), as the first-order
backward.  Each pair pays the first walk's products twice (once per ring):
where one process's fused kernel keeps P, dP, G and W between its walks, the
ring forms them again in the second.

`RingGradients` is the first-order backward (`attngrad.ring.backward`) as a
Function whose backward is this pass (`RingSecondOrder`, not differentiable
again) and whose jvp follows as `attngrad.autograd.gradients`'s: the first-order
ring on the cotangents' tangents plus this pass along the inputs' tangents.
Every rank runs the same rings: which of g_k, g_v travel, and which gradients
travel home, are agreed first (one small all_gather).
"""

from __future__ import annotations

from typing import Any

import torch

from attngrad.autograd.gradients import in_dtypes_of
from attngrad.autograd.linearized import Terminal
from attngrad.autograd.second_order import ROW_SUMS, second_order_of, sums_of
from attngrad.core.amp import no_autocast
from attngrad.core.ops import compute_dtype
from attngrad.ring.backward import ring_gradients
from attngrad.ring.blocks import (
    Ring,
    Tensors,
    block_pair,
    block_problem,
    carry_home,
    circulate,
    mask_block,
    rows_of,
)
from attngrad.ring.layout import Block

__all__ = ["RingGradients", "RingSecondOrder", "ring_second_order"]

Optional = torch.Tensor | None

# RingGradients.apply(ring, scale, need, *TENSORS) and RingSecondOrder.apply(ring, scale,
# need, *cotangents, *TENSORS): the tensors in this order, then the captured ones.
TENSORS = ("dout", "dlse", "q", "k", "v", "bias", "keep", "o", "stats")


def ring_second_order(
    ring: Ring,
    scale: float,
    cotangents: tuple[Optional, ...],
    tensors: tuple[Optional, ...],
    need: tuple[bool, ...],
) -> tuple[Optional, ...]:
    """Gradients of <g, (dq, dk, dv, dbias, *dcaptured)> summed over the ranks, this rank's
    share: w.r.t. (dout, dlse, q, k, v, bias, *captured), compute dtype, None where ``need``
    says no (the module docstring).

    cotangents g = (g_q, g_k, g_v, g_bias, *g_captured), this rank's, each like its
    input (None: zero); tensors: (dout, dlse, q, k, v, bias, keep, o, stats, *captured)
    as `RingGradients` takes them.
    """
    dout, dlse, q, k, v, bias, keep, o, stats, *captured_ = tensors
    assert q is not None and k is not None and v is not None and o is not None
    assert stats is not None
    g_q, g_k, g_v, g_bias, *g_captured = cotangents
    captured, mask = tuple(t for t in captured_ if t is not None), (bias, keep)
    n, dtype = q.shape[2], compute_dtype(q.dtype)
    dout = torch.zeros_like(o) if dout is None else dout
    need_dout, need_dlse, need_q, need_k, need_v, need_bias, *need_captured = need
    # which tensors travel, the same on every rank
    moving_k, moving_v, need_k, need_v = ring.comm.any(
        (g_k is not None, g_v is not None, need_k, need_v), q.device,
        "agreeing on what the second order's rings carry",
    )  # fmt: skip
    travel: Tensors = (k, v)
    if moving_k:
        travel += (torch.zeros_like(k) if g_k is None else g_k.contiguous(),)
    if moving_v:
        travel += (torch.zeros_like(v) if g_v is None else g_v.contiguous(),)

    def block_cotangents(blk: Block, shards: Tensors, pair: Any) -> tuple[Optional, ...]:
        g_kc = shards[2] if moving_k else None
        g_vc = shards[2 + moving_k] if moving_v else None
        return (
            None if g_q is None else rows_of(g_q, blk.rows),
            None if g_kc is None else rows_of(g_kc, blk.cols),
            None if g_vc is None else rows_of(g_vc, blk.cols),
            mask_block(g_bias, blk),
            *(() if pair is None else pair.pick(tuple(g_captured))),
        )

    def pairs(blocks: list[Block], shards: Tensors) -> Any:
        """Each of the step's pairs that holds a score: (block, problem, final, cotangents,
        pair)."""
        for blk in blocks:
            problem = block_problem(ring, blk, q, shards[0], shards[1], scale, mask,
                                    captured=captured)  # fmt: skip
            if problem is None:
                continue
            final = {"o": rows_of(o, blk.rows), "stats": rows_of(stats, blk.rows)}
            pair = block_pair(ring, blk, problem.q, problem.k, problem.v)
            yield blk, problem, final, block_cotangents(blk, shards, pair), pair

    # ring 1: the row sums over every key
    sums = torch.zeros((*q.shape[:3], ROW_SUMS), dtype=dtype, device=q.device)

    def add_sums(blocks: list[Block], shards: Tensors) -> None:
        for blk, problem, final, cot, _ in pairs(blocks, shards):
            part = sums_of(ring.strategy, problem, final, cot, rows_of(dout, blk.rows))
            rows_of(sums, blk.rows).add_(part)

    circulate(ring, n, travel, add_sums)

    # ring 2: the gradients, grad k and grad v carried home
    grad_dout = torch.zeros(o.shape, dtype=dtype, device=q.device) if need_dout else None
    grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device) if need_q else None
    grad_bias = None
    if need_bias and bias is not None:
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=q.device)
    grad_captured = tuple(
        torch.zeros(t.shape, dtype=dtype, device=t.device) if wanted else None
        for t, wanted in zip(captured, need_captured, strict=True)
    )
    likes = (k,) * need_k + (v,) * need_v

    def add_share(blocks: list[Block], shards: Tensors, accumulators: Tensors) -> None:
        grad_kc = accumulators[0] if need_k else None
        grad_vc = accumulators[need_k] if need_v else None
        for blk, problem, final, cot, pair in pairs(blocks, shards):
            picked = () if pair is None else pair.pick(grad_captured)
            wanted = (need_dout, False, need_q, need_k, need_v, grad_bias is not None,
                      *(t is not None for t in picked))  # fmt: skip
            dlse_b = None if dlse is None else rows_of(dlse, blk.rows)
            parts = second_order_of(
                ring.strategy, problem, final, cot, rows_of(dout, blk.rows), dlse_b, wanted,
                rows_of(sums, blk.rows),
            )  # fmt: skip
            into = (
                None if grad_dout is None else rows_of(grad_dout, blk.rows),
                None,
                None if grad_q is None else rows_of(grad_q, blk.rows),
                None if grad_kc is None else rows_of(grad_kc, blk.cols),
                None if grad_vc is None else rows_of(grad_vc, blk.cols),
                mask_block(grad_bias, blk),
                *picked,
            )
            for total, part in zip(into, parts, strict=True):
                if total is not None and part is not None:
                    total += part

    home = carry_home(ring, n, travel, likes, add_share)
    grad_k = home[0] if need_k else None
    grad_v = home[need_k] if need_v else None
    r = sums[..., 1] if need_dlse else None
    return grad_dout, r, grad_q, grad_k, grad_v, grad_bias, *grad_captured


class RingGradients(torch.autograd.Function):
    """(dq, dk, dv, dbias, *dcaptured) of `attngrad.ring.attention.RingAttention`,
    differentiable once more (the module docstring).

    RingGradients.apply(ring, scale, need, dout, dlse, q, k, v, bias, keep, o, stats,
    *captured): ``need`` as `attngrad.ring.backward.ring_gradients`'s; o and stats the
    forward's outputs, whose dependence on q, k and v the second-order pass includes (their
    own gradients are None).
    """

    @staticmethod
    def forward(ring: Ring, scale: float, need: tuple[bool, ...], *tensors: Any) -> Any:
        dout, dlse, q, k, v, bias, keep, o, stats, *captured = tensors
        return ring_gradients(
            ring, scale, dout, dlse, q, k, v, bias, keep, o, stats, tuple(captured), need
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ring, scale, need, *tensors = inputs
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.set_materialize_grads(False)
        ctx.ring, ctx.scale, ctx.need = ring, scale, need

    @staticmethod
    @no_autocast
    def backward(ctx: Any, *cotangents: Optional) -> tuple[Optional, ...]:
        tensors = ctx.saved_tensors
        wanted = ctx.needs_input_grad[3:]
        # (dout, dlse, q, k, v, bias, *captured): keep, o and stats take none
        need = (*wanted[:6], *wanted[9:])
        grads: tuple[Optional, ...] = (None,) * len(need)
        if any(need):
            grads = RingSecondOrder.apply(ctx.ring, ctx.scale, need, *cotangents, *tensors)  # type: ignore[no-untyped-call]
        return (None, None, None, *grads[:6], None, None, None, *grads[6:])

    @staticmethod
    @no_autocast
    def jvp(ctx: Any, *tangents: Optional) -> tuple[Optional, ...]:
        tensors, ring, scale, need = ctx.saved_tensors, ctx.ring, ctx.scale, ctx.need
        t = tangents[3:]
        # B'(x; c) = B(x; c') + H_c x': the cotangents' tangents through the first-order
        # ring, the inputs' tangents as the second-order pass's cotangents
        moving_cotangent, moving_input = ring.comm.any(
            (t[0] is not None or t[1] is not None, any(x is not None for x in t[2:])),
            tensors[2].device, "agreeing on the gradients' tangents",
        )  # fmt: skip
        out: list[Optional] = [None] * (4 + len(tensors) - 9)
        if moving_cotangent:
            first = RingGradients.apply(ring, scale, need, t[0], t[1], *tensors[2:])  # type: ignore[no-untyped-call]
            out = list(first)
        if moving_input:
            direction = (t[2], t[3], t[4], t[5], *t[9:])
            wanted = (False, False, *need)
            second = RingSecondOrder.apply(ring, scale, wanted, *direction, *tensors)[2:]  # type: ignore[no-untyped-call]
            out = [a if b is None else (b if a is None else a + b)
                   for a, b in zip(out, second, strict=True)]  # fmt: skip
        return tuple(out)


class RingSecondOrder(Terminal):
    """`ring_second_order` as a Function that is not differentiated again.

    RingSecondOrder.apply(ring, scale, need, *cotangents, *tensors) -> (grad dout, grad dlse,
    grad q, grad k, grad v, grad bias, *grad captured), each in its tensor's dtype: need,
    cotangents and tensors as `ring_second_order` takes them (4 + n cotangents for n
    captured tensors)."""

    MISSING = (
        "third derivatives of ring attention are not implemented: its gradients can be "
        "differentiated once more (double backward, Hessian-vector products), not twice."
    )

    @staticmethod
    def forward(ring: Ring, scale: float, need: tuple[bool, ...], *args: Optional) -> Any:
        n = (len(args) - len(TENSORS) + 4) // 2  # 4 + n_captured cotangents
        cotangents, tensors = tuple(args[:n]), tuple(args[n:])
        grads = ring_second_order(ring, scale, cotangents, tensors, need)
        dout, dlse, q, k, v, bias, _, _, _, *captured = tensors
        return in_dtypes_of(grads, (dout, dlse, q, k, v, bias, *captured))
