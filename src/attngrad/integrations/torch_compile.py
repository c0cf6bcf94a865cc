"""Attention as two opaque ``torch.library`` ops, the path `attention` takes under torch.compile.

Dynamo cannot trace an autograd.Function that defines ``jvp`` (every
strategy's does), nor the host-side steps of a call: reading ``cu_seqlens``,
drawing the dropout seed, choosing which tiles a band skips.  So while
compiling, `attention` hands the call to two custom ops instead:

    attngrad::forward(q, k, v, bias, keep, cu_q, cu_k, ...)
        -> [O, lse, seed, *saved]         the strategy's forward, run eagerly
    attngrad::backward(dout, dlse, q, k, v, o, bias, keep, cu_q, cu_k, seed, saved, ...)
        -> [dq, dk, dv, dbias]            its ``backward_into``

Each is one node of the compiled graph (no graph break, ``fullgraph=True``
works) with a fake implementation that gives shapes from the strategy's
declaration (``saves``), and the forward's autograd formula is the backward
op.  The same strategy code runs as in eager mode, so results are bit for bit
eager's.  With dropout the forward op draws (seed, offset) from the default
generator when it runs, as eager `attention` does, and returns them for the
backward op: the same mask as eager when attention is the graph's only random
op (Inductor seeds its own random ops from the same generator, which moves
the draw).  The bias and keep tensors are views of ``attn_mask``
made in the traced graph, so a float mask's gradient flows back through them.

What the op path does not give: double backward and forward mode (eager
attngrad has both; the compiled graph stops at first order), an explicit
``generator`` for dropout (the default generator is used), and CUDA-graph
capture (``mode="reduce-overhead"``): the ops read the seed and the segments
on the host.
"""

from __future__ import annotations

import torch

from attngrad.autograd.gradients import first_order, saved_dict
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed
from attngrad.core.keywords import validate_segments
from attngrad.core.masks import Mask
from attngrad.core.ops import compute_dtype, lse
from attngrad.strategies import MODULES

__all__ = ["attention"]


def _mask(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    seed: torch.Tensor,
    left: int | None,
    right: int | None,
    align: str,
    softcap: float | None,
    dropout_p: float,
) -> Mask:
    """The call's `Mask` for q [B, Hq, Nq, d], k, v, from the ops' arguments.

    Host values (the segments, the seed) are read here, when the op runs.
    """
    shapes = Shapes.of(q, k, v)
    segments = validate_segments(cu_q, cu_k, shapes, q.device)
    dropout = None
    if dropout_p > 0:
        word, offset = (int(x) for x in seed.tolist())
        dropout = Dropout(dropout_p, word, offset)
    # (left, right) already hold is_causal (`causal_band`), so the band is built as a window
    mask = Mask.build(
        None, False, (left, right), shapes, align, segments, softcap, dropout, q.device
    )
    return mask.with_tensors(bias, keep)


def _names(strategy: str, shapes: Shapes) -> tuple[str, ...]:
    """The strategy's saved tensors beyond O, in declaration order."""
    return tuple(n for n in MODULES[strategy].saves(shapes) if n != "o")


@torch.library.custom_op(  # type: ignore[misc]
    "attngrad::forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    strategy: str,
    scale: float,
    left: int | None,
    right: int | None,
    align: str,
    softcap: float | None,
    dropout_p: float,
    block_q: int | None,
    block_k: int | None,
) -> list[torch.Tensor]:
    """[O, lse, seed, *saved] of ``strategy``'s forward.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; bias / keep:
    [Bm, Hm, Nqm, Nkm] or None (`attngrad.core.masks.split_mask`); cu_q, cu_k: 1-D
    cumulative segment lengths or None; left, right: the band (None: open).
    Returns O [B, Hq, Nq, dv], lse [B, Hq, Nq] (compute dtype), seed int64 [2]
    (seed, offset) with dropout else [0], then the strategy's saved tensors
    (`saves` order, without "o"), all contiguous.
    """
    impl = MODULES[strategy]
    seed = torch.empty(0, dtype=torch.int64)
    if dropout_p > 0:
        seed = torch.tensor(draw_seed(q.device, None), dtype=torch.int64)
    mask = _mask(q, k, v, bias, keep, cu_q, cu_k, seed, left, right, align, softcap, dropout_p)
    shapes = Shapes.of(q, k, v)
    o, saved = impl.forward(q, k, v, mask, scale, impl.tiles(shapes, q.dtype, block_q, block_k))
    out = [o, lse(saved["stats"]), seed, *(saved[n] for n in _names(strategy, shapes))]
    return [t.contiguous() for t in out]  # the layout the fake declares


@_forward.register_fake  # type: ignore[misc]
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *tensors_and_options: object
) -> list[torch.Tensor]:
    strategy, dropout_p = tensors_and_options[4], tensors_and_options[10]
    assert isinstance(strategy, str) and isinstance(dropout_p, float)
    shapes = Shapes.of(q, k, v)
    stat = compute_dtype(q.dtype)
    declared = MODULES[strategy].saves(shapes)
    o = q.new_empty((shapes.batch, shapes.heads_q, shapes.seq_q, shapes.value_dim))
    out = [o, q.new_empty(o.shape[:-1], dtype=stat)]
    out.append(q.new_empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64, device="cpu"))
    for name in _names(strategy, shapes):
        shape, kind = declared[name]
        out.append(q.new_empty(shape, dtype=q.dtype if kind == "input" else stat))
    return out


@torch.library.custom_op("attngrad::backward", mutates_args=())  # type: ignore[misc]
def _backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    seed: torch.Tensor,
    saved: list[torch.Tensor],
    strategy: str,
    scale: float,
    left: int | None,
    right: int | None,
    align: str,
    softcap: float | None,
    dropout_p: float,
    block_q: int | None,
    block_k: int | None,
    need: list[bool],
) -> list[torch.Tensor]:
    """[dq, dk, dv, dbias] from the strategy's backward: shaped like q, k, v and bias
    in their dtypes, contiguous, or [0] in q's dtype where ``need`` says no.

    dout: [B, Hq, Nq, dv]; dlse: [B, Hq, Nq] or None; o, seed, saved: the
    forward op's outputs; the rest as `_forward` takes them.
    """
    impl = MODULES[strategy]
    shapes = Shapes.of(q, k, v)
    mask = _mask(q, k, v, bias, keep, cu_q, cu_k, seed, left, right, align, softcap, dropout_p)
    kept = saved_dict(
        o if "o" in impl.saves(shapes) else None, _names(strategy, shapes), tuple(saved)
    )
    grads = first_order(
        dout, dlse, q, k, v, bias, keep, kept, mask, scale,
        impl.tiles(shapes, q.dtype, block_q, block_k), impl, tuple(need),
    )  # fmt: skip
    # a fresh empty tensor per unneeded gradient: outputs may not alias each other
    return [q.new_empty(0) if g is None else g.contiguous() for g in grads]


@_backward.register_fake  # type: ignore[misc]
def _(dout, dlse, q, k, v, o, bias, keep, cu_q, cu_k, seed, saved, *args):  # type: ignore[no-untyped-def]
    need = args[-1]
    likes = (q, k, v, bias)
    return [
        t.new_empty(t.shape) if t is not None and n else q.new_empty(0)  # contiguous
        for t, n in zip(likes, need, strict=True)
    ]


def _setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    q, k, v, bias, keep, cu_q, cu_k, *options = inputs
    o, _, seed, *saved = output
    ctx.save_for_backward(q, k, v, o, bias, keep, cu_q, cu_k, seed, *saved)
    ctx.options = options


def _autograd(ctx, grads):  # type: ignore[no-untyped-def]
    dout, dlse = grads[0], grads[1]
    q, k, v, o, bias, keep, cu_q, cu_k, seed, *saved = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(o)
    need = [*ctx.needs_input_grad[:3], bias is not None and ctx.needs_input_grad[3]]
    out = _backward(dout, dlse, q, k, v, o, bias, keep, cu_q, cu_k, seed, saved, *ctx.options, need)
    dq, dk, dv, dbias = (g if n else None for g, n in zip(out, need, strict=True))
    return dq, dk, dv, dbias, *(None for _ in range(12))


torch.library.register_autograd("attngrad::forward", _autograd, setup_context=_setup)


def attention(
    strategy: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: tuple[torch.Tensor | None, torch.Tensor | None],
    segments: tuple[torch.Tensor | None, torch.Tensor | None],
    band: tuple[int | None, int | None],
    align: str,
    softcap: float | None,
    dropout_p: float,
    scale: float,
    block_q: int | None,
    block_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O: [B, Hq, Nq, dv], lse: [B, Hq, Nq]) through the ops, over the canonical layout.

    mask: (bias, keep) as `attngrad.core.masks.Mask` holds them; segments: the raw
    (cu_seqlens_q, cu_seqlens_k) (validated when the op runs); band: (left,
    right) after is_causal is folded in.
    """
    reason = MODULES[strategy].unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    out = _forward(
        q, k, v, *mask, *segments, strategy, scale, *band, align, softcap, float(dropout_p),
        block_q, block_k,
    )  # fmt: skip
    return out[0], out[1]
