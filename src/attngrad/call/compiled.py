"""The compiled route of a `Call`: two opaque ``torch.library`` ops, the path under torch.compile.

Dynamo cannot trace an autograd.Function that defines ``jvp`` (every
strategy's does), nor the host-side steps of a call: reading ``cu_seqlens``,
drawing the dropout seed, choosing which tiles a band skips.  So while
compiling, `attngrad.attention` builds its `Call` in the traced graph (the
bias and keep views of ``attn_mask`` among it, so a float mask's gradient
flows back through them) and hands the rest to two custom ops:

    attngrad::forward(q, k, v, bias, keep, cu_q, cu_k, ...)
        -> [O, lse, seed, band_lo, band_hi, *saved]     the strategy's forward, run eagerly
    attngrad::backward(dout, dlse, q, k, v, o, bias, keep, band_lo, band_hi, seed, saved, ...)
        -> [dq, dk, dv, dbias]                          its ``backward_into``

Each is one node of the compiled graph (no graph break, ``fullgraph=True``
works) with a fake implementation that gives shapes from the strategy's
declaration (``saves``), and the forward's autograd formula is the backward
op.  The same strategy code runs as in eager mode, so results are bit for bit
eager's.  The forward op reads the segments and lays out the band once
(`attngrad.core.band.BandSpec.build`) and hands its rows' intervals to the
backward op.  With dropout it draws (seed, offset) from the default generator
when it runs, as the eager route does, and returns them for the backward
op: the same mask as eager when attention is the graph's only random op
(Inductor seeds its own random ops from the same generator, which moves the
draw).

What the op path does not give: double backward and forward mode (eager
attngrad has both; the compiled graph stops at first order), an explicit
``generator`` for dropout (the default generator is used), and CUDA-graph
capture (``mode="reduce-overhead"``): the ops read the seed and the segments
on the host.
"""

from __future__ import annotations

import torch

from attngrad.autograd.gradients import first_order
from attngrad.call.call import Call
from attngrad.core.band import Band, BandSpec, validate_segments
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed
from attngrad.core.interface import Plan, Problem
from attngrad.core.ops import compute_dtype, lse
from attngrad.core.scores import ScoreMods
from attngrad.strategies import REGISTRY

__all__ = ["run"]


def _banded(left: int | None, right: int | None, cu_q: torch.Tensor | None) -> bool:
    """Whether the call has a band (`BandSpec.bounded`, the segments not read yet)."""
    return BandSpec(left, right).bounded or cu_q is not None


def _score_mods(
    shapes: Shapes,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    band: Band | None,
    seed: torch.Tensor,
    softcap: float | None,
    dropout_p: float,
) -> ScoreMods:
    """The call's `ScoreMods` from the ops' arguments; (seed, offset) are read here."""
    dropout = None
    if dropout_p > 0:
        word, offset = (int(x) for x in seed.tolist())
        dropout = Dropout(dropout_p, word, offset)
    return ScoreMods(
        bias, keep, band, shapes.heads_kv, shapes.seq_q, shapes.seq_k, softcap, dropout
    )


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
    """[O, lse, seed, band_lo, band_hi, *saved] of ``strategy``'s forward.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; bias / keep:
    [Bm, Hm, Nqm, Nkm] or None (`Call`'s); cu_q, cu_k: 1-D cumulative segment
    lengths or None, read here; left, right, align: the band (`BandSpec`).
    Returns O [B, Hq, Nq, dv], lse [B, Hq, Nq] (compute dtype), seed int64 [2]
    (seed, offset) with dropout else [0], the band's int64 lo and hi [Nq]
    (`attngrad.core.band.Band`; [0] without a band), then the strategy's
    saved tensors (`saves` order, without "o"), all contiguous.
    """
    impl = REGISTRY[strategy]
    shapes = Shapes.of(q, k, v)
    seed = torch.empty(0, dtype=torch.int64)
    if dropout_p > 0:
        seed = torch.tensor(draw_seed(q.device, None), dtype=torch.int64)
    segments = validate_segments(cu_q, cu_k, shapes, q.device)
    band = BandSpec(left, right, align, segments).build(shapes.seq_q, shapes.seq_k, q.device)
    mods = _score_mods(shapes, bias, keep, band, seed, softcap, dropout_p)
    tiles = impl.tiles(shapes, q.dtype, block_q, block_k)
    o, saved = impl.forward(Problem(q, k, v, mods, scale, tiles))
    none = q.new_empty(0, dtype=torch.int64)
    lo, hi = (band.lo, band.hi) if band is not None else (none, none.clone())
    out = [o, lse(saved["stats"]), seed, lo, hi, *(saved[n] for n in impl.saved_names(shapes))]
    return [t.contiguous() for t in out]  # the layout the fake declares


@_forward.register_fake  # type: ignore[misc]
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *tensors_and_options: object
) -> list[torch.Tensor]:
    cu_q, strategy, left, right = (tensors_and_options[i] for i in (2, 4, 6, 7))
    dropout_p = tensors_and_options[10]
    assert isinstance(strategy, str) and isinstance(dropout_p, float)
    shapes = Shapes.of(q, k, v)
    stat = compute_dtype(q.dtype)
    impl = REGISTRY[strategy]
    declared = impl.saves(shapes)
    o = q.new_empty((shapes.batch, shapes.heads_q, shapes.seq_q, shapes.value_dim))
    out = [o, q.new_empty(o.shape[:-1], dtype=stat)]
    out.append(q.new_empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64, device="cpu"))
    rows = shapes.seq_q if _banded(left, right, cu_q) else 0  # type: ignore[arg-type]
    out += [q.new_empty((rows,), dtype=torch.int64) for _ in ("lo", "hi")]
    for name in impl.saved_names(shapes):
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
    band_lo: torch.Tensor | None,
    band_hi: torch.Tensor | None,
    seed: torch.Tensor,
    saved: list[torch.Tensor],
    strategy: str,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    block_q: int | None,
    block_k: int | None,
    need: list[bool],
) -> list[torch.Tensor]:
    """[dq, dk, dv, dbias] from the strategy's backward: shaped like q, k, v and bias
    in their dtypes, contiguous, or [0] in q's dtype where ``need`` says no.

    dout: [B, Hq, Nq, dv]; dlse: [B, Hq, Nq] or None; o, band_lo, band_hi
    (None without a band), seed, saved: the forward op's outputs; the rest as
    `_forward` takes them.
    """
    impl = REGISTRY[strategy]
    shapes = Shapes.of(q, k, v)
    band = None if band_lo is None or band_hi is None else Band(band_lo, band_hi, shapes.seq_k)
    mods = _score_mods(shapes, bias, keep, band, seed, softcap, dropout_p)
    problem = Problem(q, k, v, mods, scale, impl.tiles(shapes, q.dtype, block_q, block_k))
    plan = Plan.of(problem, impl)
    kept = plan.saved(o if "o" in impl.saves(shapes) else None, tuple(saved))
    grads = first_order(impl, problem, kept, dout, dlse, tuple(need))
    # a fresh empty tensor per unneeded gradient: outputs may not alias each other
    return [q.new_empty(0) if g is None else g.contiguous() for g in grads]


@_backward.register_fake  # type: ignore[misc]
def _(dout, dlse, q, k, v, o, bias, keep, band_lo, band_hi, seed, saved, *args):  # type: ignore[no-untyped-def]
    need = args[-1]
    likes = (q, k, v, bias)
    return [
        t.new_empty(t.shape) if t is not None and n else q.new_empty(0)  # contiguous
        for t, n in zip(likes, need, strict=True)
    ]


def _setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    q, k, v, bias, keep, cu_q, _, strategy, scale, left, right, _, *options = inputs
    o, _, seed, lo, hi, *saved = output
    if not _banded(left, right, cu_q):
        lo = hi = None
    ctx.save_for_backward(q, k, v, o, bias, keep, lo, hi, seed, *saved)
    ctx.options = (strategy, scale, *options)  # softcap, dropout_p, block_q, block_k


def _autograd(ctx, grads):  # type: ignore[no-untyped-def]
    dout, dlse = grads[0], grads[1]
    q, k, v, o, bias, keep, lo, hi, seed, *saved = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(o)
    need = [*ctx.needs_input_grad[:3], bias is not None and ctx.needs_input_grad[3]]
    out = _backward(dout, dlse, q, k, v, o, bias, keep, lo, hi, seed, saved, *ctx.options, need)
    dq, dk, dv, dbias = (g if n else None for g, n in zip(out, need, strict=True))
    return dq, dk, dv, dbias, *(None for _ in range(12))


torch.library.register_autograd("attngrad::forward", _autograd, setup_context=_setup)


def run(
    call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O: [B, Hq, Nq, dv], lse: [B, Hq, Nq]) of ``call`` through the ops, over
    q: [B, Hq, Nq, d], k, v (`Call.inputs`); the segments are read when the op runs.
    """
    band = call.band
    out = _forward(
        q, k, v, call.bias, call.keep, *call.cu_seqlens, call.strategy, call.scale, band.left,
        band.right, band.align, call.softcap, call.dropout_p, call.block_q, call.block_k,
    )  # fmt: skip
    return out[0], out[1]
