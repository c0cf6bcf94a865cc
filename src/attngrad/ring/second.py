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

A rank holds its shards, the shards in hand and in flight and two sets of
accumulators (its own pairs' share, computed first while the first shards
travel, and the travelling ones), and each pair's kernel its own tiles: O(N/P),
as the first-order backward; as there, the kv heads are cut into up to
`attngrad.ring.backward.HEAD_GROUPS` groups, each with rings of its own, so
what is in flight is a group's.  Each pair pays the first walk's products twice (once per ring):
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

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from attngrad.autograd.gradients import in_dtypes_of
from attngrad.autograd.linearized import Terminal
from attngrad.autograd.second_order import ROW_SUMS, second_order_of, sums_of
from attngrad.core.amp import no_autocast
from attngrad.core.ops import compute_dtype
from attngrad.ring.backward import HEAD_GROUPS, ring_gradients
from attngrad.ring.blocks import (
    Ring,
    Tensors,
    Travel,
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


@dataclass(frozen=True)
class _Part:
    """A group of heads' tensors (`HEAD_GROUPS`): this rank's rows' q [B, h, n, d], o, dout
    [B, h, n, dv], stats [B, h, n, 2], dlse [B, h, n] (or None), g_q (like q, or None); and
    what travels, k, v, g_k and g_v (`Travel`); sums: [B, h, n, ROW_SUMS], filled by the
    first ring."""

    q: torch.Tensor
    o: torch.Tensor
    stats: torch.Tensor
    dout: torch.Tensor
    dlse: Optional
    g_q: Optional
    travel: Travel
    sums: torch.Tensor

    def heads(self, qh: slice, kh: slice) -> _Part:
        def cut(t: Optional, h: slice) -> Optional:
            return None if t is None else t[:, h]

        return _Part(
            self.q[:, qh], self.o[:, qh], self.stats[:, qh], self.dout[:, qh],
            cut(self.dlse, qh), cut(self.g_q, qh),
            self.travel.heads(kh), self.sums[:, qh],
        )  # fmt: skip


@dataclass(frozen=True)
class _Rings:
    """What every group's rings share: the call's mask (bias, keep), g_bias, captured
    tensors and g_captured (whole: with any of them the heads are one group), and the
    wanted gradients' accumulators (None: not wanted): grad dout, grad q (views of a
    group's heads are taken), grad bias, grad captured; grad k and grad v are wanted where
    ``need_k``, ``need_v`` (agreed by the ranks)."""

    need_k: bool
    need_v: bool
    mask: tuple[Optional, Optional]
    g_bias: Optional
    captured: Tensors
    g_captured: tuple[Optional, ...]
    grad_dout: Optional
    grad_q: Optional
    grad_bias: Optional
    grad_captured: tuple[Optional, ...]


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
    as `RingGradients` takes them.  As the first-order backward, the kv heads are cut
    into up to `HEAD_GROUPS` groups, each with rings of its own (one group with dropout,
    a mask or a flex call), so the buffers in flight are a group's.
    """
    dout, dlse, q, k, v, bias, keep, o, stats, *captured = tensors
    assert q is not None and k is not None and v is not None and o is not None
    assert stats is not None
    g_q, g_k, g_v, g_bias, *g_captured = cotangents
    dtype = compute_dtype(q.dtype)
    need_dout, need_dlse, need_q, need_k, need_v, need_bias, *need_captured = need
    moving_k, moving_v, need_k, need_v = ring.comm.any(
        (g_k is not None, g_v is not None, need_k, need_v), q.device,
        "agreeing on what the second order's rings carry",
    )  # fmt: skip
    travel = Travel.of(k, v, g_k, g_v, (moving_k, moving_v))

    def zeros(like: torch.Tensor, wanted: bool = True) -> Optional:
        return torch.zeros(like.shape, dtype=dtype, device=like.device) if wanted else None

    whole = _Part(q, o, stats, torch.zeros_like(o) if dout is None else dout, dlse, g_q, travel,
                  torch.zeros((*q.shape[:3], ROW_SUMS), dtype=dtype, device=q.device))  # fmt: skip
    common = _Rings(
        need_k, need_v, (bias, keep), g_bias, tuple(t for t in captured if t is not None),
        tuple(g_captured), zeros(o, need_dout), zeros(q, need_q),
        None if bias is None else zeros(bias, need_bias),
        tuple(zeros(t, w) for t, w in zip(captured, need_captured, strict=True) if t is not None),
    )  # fmt: skip
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    one = ring.dropout is not None or bias is not None or keep is not None or ring.flex is not None
    groups = 1 if one else min(hkv, HEAD_GROUPS)
    if groups == 1:  # grad k and grad v are the accumulators that come home
        home = iter(_group_rings(ring, scale, whole, common, own_first=False))
        grad_k = next(home) if need_k else None
        grad_v = next(home) if need_v else None
        return _gradients(whole, common, grad_k, grad_v, need_dlse)
    grad_k, grad_v = zeros(k, need_k), zeros(v, need_v)
    bounds = [hkv * i // groups for i in range(groups + 1)]
    for h0, h1 in itertools.pairwise(bounds):
        qh, kh = slice(h0 * g, h1 * g), slice(h0, h1)
        views = replace(
            common, grad_dout=_cut(common.grad_dout, qh), grad_q=_cut(common.grad_q, qh)
        )
        home = iter(_group_rings(ring, scale, whole.heads(qh, kh), views, own_first=True))
        for total in (grad_k, grad_v):
            if total is not None:
                total[:, kh] = next(home)
    return _gradients(whole, common, grad_k, grad_v, need_dlse)


def _gradients(
    whole: _Part, c: _Rings, grad_k: Optional, grad_v: Optional, need_dlse: bool
) -> tuple[Optional, ...]:
    """`ring_second_order`'s result from its accumulators (grad dlse: the row sums' r)."""
    r = whole.sums[..., 1] if need_dlse else None
    return (c.grad_dout, r, c.grad_q, grad_k, grad_v, c.grad_bias, *c.grad_captured)


def _cut(t: Optional, h: slice) -> Optional:
    return None if t is None else t[:, h]


def _group_rings(ring: Ring, scale: float, x: _Part, c: _Rings, own_first: bool) -> Tensors:
    """The two rings for one group of heads: fills x.sums, adds into c's accumulators (views
    of the group's heads), returns its grad k and grad v (those wanted, in that order;
    `carry_home` takes ``own_first``)."""
    n = x.q.shape[2]

    def block_cotangents(blk: Block, shards: Tensors, pair: Any) -> tuple[Optional, ...]:
        g_kc, g_vc = x.travel.directions(shards)
        return (
            None if x.g_q is None else rows_of(x.g_q, blk.rows),
            None if g_kc is None else rows_of(g_kc, blk.cols),
            None if g_vc is None else rows_of(g_vc, blk.cols),
            mask_block(c.g_bias, blk),
            *(() if pair is None else pair.pick(c.g_captured)),
        )

    def pairs(blocks: list[Block], shards: Tensors) -> Iterator[tuple[Any, ...]]:
        """Each of the step's pairs that holds a score: (block, problem, final, cotangents,
        pair)."""
        for blk in blocks:
            problem = block_problem(ring, blk, x.q, shards[0], shards[1], scale, c.mask,
                                    captured=c.captured)  # fmt: skip
            if problem is None:
                continue
            final = {"o": rows_of(x.o, blk.rows), "stats": rows_of(x.stats, blk.rows)}
            pair = block_pair(ring, blk, problem.q, problem.k, problem.v)
            yield blk, problem, final, block_cotangents(blk, shards, pair), pair

    # ring 1: the row sums over every key
    def add_sums(blocks: list[Block], shards: Tensors) -> None:
        for blk, problem, final, cot, _ in pairs(blocks, shards):
            part = sums_of(ring.strategy, problem, final, cot, rows_of(x.dout, blk.rows))
            rows_of(x.sums, blk.rows).add_(part)

    circulate(ring, n, x.travel.tensors, add_sums)

    # ring 2: the gradients, grad k and grad v carried home
    def add_share(blocks: list[Block], shards: Tensors, accumulators: Tensors) -> None:
        grad_kc = accumulators[0] if c.need_k else None
        grad_vc = accumulators[c.need_k] if c.need_v else None
        for blk, problem, final, cot, pair in pairs(blocks, shards):
            picked = () if pair is None else pair.pick(c.grad_captured)
            wanted = (c.grad_dout is not None, False, c.grad_q is not None, c.need_k,
                      c.need_v, c.grad_bias is not None, *(t is not None for t in picked))  # fmt: skip
            dlse_b = None if x.dlse is None else rows_of(x.dlse, blk.rows)
            parts = second_order_of(
                ring.strategy, problem, final, cot, rows_of(x.dout, blk.rows), dlse_b, wanted,
                rows_of(x.sums, blk.rows),
            )  # fmt: skip
            into = (
                None if c.grad_dout is None else rows_of(c.grad_dout, blk.rows),
                None,
                None if c.grad_q is None else rows_of(c.grad_q, blk.rows),
                None if grad_kc is None else rows_of(grad_kc, blk.cols),
                None if grad_vc is None else rows_of(grad_vc, blk.cols),
                mask_block(c.grad_bias, blk),
                *picked,
            )
            for total, got in zip(into, parts, strict=True):
                if total is not None and got is not None:
                    total += got

    likes = x.travel.tensors[:1] * c.need_k + x.travel.tensors[1:2] * c.need_v
    return carry_home(ring, n, x.travel.tensors, likes, add_share, own_first)


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
        if moving_input and not moving_cotangent and retrieve_all_functorch_interpreters():
            # under torch.func.jvp, tangents made by the second-order Function alone trip
            # torch's forward-grad check on this Function's outputs (an internal assert);
            # through the first-order ring too (on a zero cotangent) they do not
            at = 0 if tensors[0] is not None else 1  # dout's, or dlse's where only lse is used
            t = tuple(torch.zeros_like(tensors[at]) if i == at else x for i, x in enumerate(t))
            moving_cotangent = True
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
