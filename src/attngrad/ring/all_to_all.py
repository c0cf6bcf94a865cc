r"""The all-to-all scheme (DeepSpeed-Ulysses): trade sequence shards for head shards and back.

Rank r of P holds q, k, v of its sequence shard, [B, H, N/P, d].  An
all-to-all trades them for all N positions of its H/P heads, [B, H/P, N, d]
(heads r H/P .. (r+1) H/P - 1, positions in the true order whatever the
layout); the rank runs plain `attngrad.attention` over the full sequence for
those heads, with every keyword; a second all-to-all trades the output (and
lse) back to the sequence shard::

    q, k, v  [B, H, N/P, d]  --seq_to_heads-->  [B, H/P, N, d]
                                                    | attention (any strategy)
    out, lse [B, H, N/P, .]  <--heads_to_seq--  [B, H/P, N, .]

The trades are linear permutations of data across the ranks, so each is an
autograd.Function (`AllToAll`) whose backward is the inverse trade, whose jvp
is the same trade of the tangent, and whose vmap rule moves the vmapped dim
into the leading dims: each is differentiable again through the same
Function, and every derivative of `attngrad.attention` -- backward, double
backward, forward mode, torch.func's transforms -- carries over.

The keywords that are tensors over the rows (an attn_mask [.., Hm, N/P, N],
per-token sinks [.., Hs, N/P]) are traded the same way when they have one
row per head (``seq_to_heads``), gathered whole when they are shared by the
heads (``gather_rows``: an all-gather, whose adjoint ``scatter_rows`` adds
each rank's rows' gradient back to their owner), sliced to the rank's heads
when they are shared by the rows, and passed as they are when shared by both
(then each rank's gradient is its heads' share, summed over the ranks by
the caller like any replicated parameter's).

Dropout hashes (seed, offset, b * H + h, i, j) (`attngrad.core.dropout`),
with the call's batch and head indices: the local call has B * H/P heads
numbered from 0 where the gathered call numbers them b * H + r H/P + h.
The hash starts from the word w = mix(mix(seed) ^ offset) and takes
mix(w ^ bh); for a block of 2^k heads whose global index starts at a
multiple a of 2^k, a + h = a ^ h, so a call over that block with the offset
that makes its first word w ^ a (mix is a bijection: `retarget`) draws the
gathered call's mask bit for bit.  The local call is cut into such blocks
(`head_blocks`): one block per batch entry when H/P and the GQA group are
powers of two, smaller ones otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from attngrad.api import attention
from attngrad.call import Call
from attngrad.core.amp import autocast_inputs, outside_autocast
from attngrad.core.band import validate_segments, validate_window
from attngrad.core.contract import (
    ArgumentError,
    Shapes,
    check_flag,
    validate_attention,
)
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Problem
from attngrad.core.keywords import validate_generator, validate_sinks, validate_softcap
from attngrad.ring.checks import (
    Settings,
    check_same_shards,
    documents_of,
    process_group,
    rows_form,
    shard_mask,
    tensor_kind,
    validate_ring,
)
from attngrad.ring.comm import DEFAULT_TIMEOUT, RingComm, shared_dropout
from attngrad.ring.layout import shards, unshard
from attngrad.strategies import REGISTRY, STRATEGIES, unavailable_reason
from attngrad.strategies.base import differentiable

__all__ = [
    "AllToAll",
    "Trade",
    "all_to_all_attention",
    "check_heads",
    "head_blocks",
    "over_heads",
    "packed_ring_attention",
    "retarget",
    "sinks_form",
    "sinks_of",
]

# -- the hash's head offset (module docstring) -----------------------------------

_M32 = 0xFFFFFFFF


def _mix(h: int) -> int:
    """MurmurHash3's 32-bit finalizer (`attngrad.core.dropout.mix32`) on a Python int."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _unmix(h: int) -> int:
    """The inverse of `_mix`: each xor-shift and each odd multiplication undone, last first."""
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 2**32)) & _M32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 2**32)) & _M32
    return h ^ (h >> 16)


def retarget(dropout: Dropout, base: int) -> Dropout:
    """``dropout`` as seen by a call whose head h is the gathered call's head ``base + h``.

    Exact for h < 2^k when ``base`` is a multiple of 2^k (base + h = base ^ h):
    the new offset makes the hash's first word mix(mix(seed) ^ offset) ^ base.
    """
    word = _mix(_mix(dropout.seed) ^ dropout.offset)
    return replace(dropout, offset=_unmix(word ^ base) ^ _mix(dropout.seed))


def head_blocks(start: int, heads: int, group: int) -> list[tuple[int, int]]:
    """[h0, h1) blocks covering local heads 0 .. heads-1, whose global heads start at ``start``.

    Each block has 2^k heads, starts at a global head that is a multiple of 2^k
    (`retarget`), and holds either whole GQA groups of ``group`` query heads
    or part of one group (its kv heads are then a slice, or one head).
    Greedy, largest first.

    >>> head_blocks(4, 4, 1), head_blocks(6, 6, 1), head_blocks(0, 6, 3)
    ([(0, 4)], [(0, 2), (2, 6)], [(0, 2), (2, 3), (3, 4), (4, 6)])
    """
    blocks, h = [], 0
    while h < heads:
        size = 1
        while True:
            bigger = 2 * size
            fits = h + bigger <= heads and (start + h) % bigger == 0
            whole = h % group == 0 and bigger % group == 0
            inside = h // group == (h + bigger - 1) // group
            if not (fits and (whole or inside)):
                break
            size = bigger
        blocks.append((h, h + size))
        h += size
    return blocks


# -- the collectives as autograd Functions -----------------------------------------

# The trades (module docstring), each with its adjoint: backward runs the adjoint.
SEQ_TO_HEADS, HEADS_TO_SEQ = "seq_to_heads", "heads_to_seq"
GATHER_ROWS, SCATTER_ROWS = "gather_rows", "scatter_rows"
_ADJOINT = {
    SEQ_TO_HEADS: HEADS_TO_SEQ,
    HEADS_TO_SEQ: SEQ_TO_HEADS,
    GATHER_ROWS: SCATTER_ROWS,
    SCATTER_ROWS: GATHER_ROWS,
}


@dataclass(frozen=True)
class Trade:
    """One kind of trade over ``comm``'s ranks, the sequence cut as ``layout`` says."""

    comm: RingComm
    layout: str
    op: str

    @property
    def adjoint(self) -> Trade:
        return replace(self, op=_ADJOINT[self.op])

    def __call__(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The trade of each x: [..., H, n, c] (see each case), no autograd; the messages of
        all of them in flight together."""
        what = f"the all-to-all scheme's {self.op}"
        if self.op == GATHER_ROWS:  # [..., Hx, n, c] -> [..., Hx, N, c], every rank's rows
            return tuple(unshard(self.comm.all_gather(x, what), self.layout) for x in xs)
        got = self.comm.all_to_all([self._pieces(x) for x in xs], what)
        return tuple(self._joined(g, x.shape) for g, x in zip(got, xs, strict=True))

    def _pieces(self, x: torch.Tensor) -> torch.Tensor:
        """What x sends: [P, ...], piece i to rank i."""
        p = self.comm.world
        h, n, c = x.shape[-3:]
        if self.op == SEQ_TO_HEADS:  # (P, M, H/P, n, c): piece i, my rows of rank i's heads
            return x.reshape(-1, p, h // p, n, c).transpose(0, 1)
        if self.op == HEADS_TO_SEQ:  # (P, M, H/P, n/P, c): piece i, rank i's rows
            return shards(x.reshape(-1, h, n, c), p, self.layout)
        # SCATTER_ROWS, GATHER_ROWS' adjoint: (P, *x's dims but n/P): piece i, rank i's rows
        return shards(x, p, self.layout)

    def _joined(self, got: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """What arrived for an x of ``shape`` ([P, ...], piece i from rank i) as the trade's
        result."""
        p = self.comm.world
        *lead, h, n, c = shape
        if self.op == SEQ_TO_HEADS:  # [..., H, n, c] -> [..., H/P, N, c]; piece i: rank i's rows
            return unshard(list(got.unbind(0)), self.layout).reshape(*lead, h // p, p * n, c)
        if self.op == HEADS_TO_SEQ:  # [..., H/P, N, c] -> [..., H, N/P, c]; piece i: head block i
            return got.transpose(0, 1).reshape(*lead, p * h, n // p, c)
        return got.sum(0)  # SCATTER_ROWS: [..., Hx, N, c] -> [..., Hx, n, c], rows summed


class AllToAll(torch.autograd.Function):
    """``trade`` on each of ``xs`` (every rank calls it with the same trade and shapes).

    Linear, so: backward is the adjoint trade of the cotangents, jvp the same
    trade of the tangents, both through this Function again (differentiable
    again: double backward, forward over reverse); vmap moves the vmapped dim
    into the leading dims (every rank must vmap alike).
    """

    @staticmethod
    def forward(trade: Trade, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return trade(*xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.trade = inputs[0]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # grads are materialized (zeros for an unused output): every rank trades alike
        return (None, *_trade(ctx.trade.adjoint, *grads))

    @staticmethod
    def jvp(
        ctx: Any, _no_tangent: None, *tangents: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        full = [
            torch.zeros(shape, dtype=dtype, device=device) if t is None else t
            for t, (shape, dtype, device) in zip(tangents, ctx.like, strict=True)
        ]  # every rank trades every tangent, present or not
        return _trade(ctx.trade, *full)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], trade: Trade, *xs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        dims = in_dims[1:]
        moved = [x if d is None else x.movedim(d, 0) for x, d in zip(xs, dims, strict=True)]
        return _trade(trade, *moved), tuple(None if d is None else 0 for d in dims)


def _trade(trade: Trade, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out: tuple[torch.Tensor, ...] = AllToAll.apply(trade, *xs)  # type: ignore[no-untyped-call]
    return out


# -- the keywords over rows: attn_mask and sinks -------------------------------------


def _to_heads(x: torch.Tensor, comm: RingComm, layout: str, heads: int, n: int) -> torch.Tensor:
    """x: [Bx, Hx, nx, c] in rows form (Hx 1 or ``heads``, nx 1 or the shard's n) ->
    [Bx, Hx', Nx, c]: the rank's heads (Hx' = H/P, or 1) over every row (Nx = N, or 1)
    (module docstring).  With n = 1 a row-shared x is taken as the rank's row."""
    p = comm.world
    if x.shape[2] == n:
        op = SEQ_TO_HEADS if x.shape[1] == heads else GATHER_ROWS
        return _trade(Trade(comm, layout, op), x)[0]
    if x.shape[1] == heads:  # shared by the rows: this rank's heads only
        hl = heads // p
        return x[:, comm.rank * hl : (comm.rank + 1) * hl]
    return x


def sinks_of(sinks: torch.Tensor | None) -> tuple[int, ...]:
    """`Settings.sinks` of validated sinks in `sinks_form`: (kind, Bs, Hs, rows), or ()."""
    return () if sinks is None else (tensor_kind(sinks), *sinks.shape[:3])


def sinks_form(sink: torch.Tensor | None, shapes: Shapes) -> torch.Tensor | None:
    """validated sinks (broadcastable to [..., Hq, n]) as [Bs, Hs, ns, 1] (`rows_form`)."""
    return None if sink is None else rows_form(sink.unsqueeze(-1), shapes.lead)


def check_heads(shapes: Shapes, world: int) -> None:
    """ValueError unless Hq and Hkv divide by the world size (each rank takes H/P heads)."""
    if shapes.heads_q % world or shapes.heads_kv % world:
        raise ArgumentError(
            f"scheme='all_to_all' gives each of the P = {world} ranks H/P whole heads, so the "
            f"query heads ({shapes.heads_q}) and the key/value heads ({shapes.heads_kv}) must "
            f"each divide by {world}. Use scheme='ring', which shards only the sequence, or a "
            "process group whose size divides both."
        )


# -- the local call ------------------------------------------------------------------------


@dataclass(frozen=True)
class Keywords:
    """What the local `attngrad.attention` call takes besides q, k, v, mask and sinks."""

    is_causal: bool
    scale: float | None
    strategy: str
    window: tuple[int | None, int | None] | None
    softcap: float | None
    cu_seqlens: torch.Tensor | None = None  # packed documents over the full sequence


def _local(
    kw: Keywords,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, lse) of `attention` over the rank's heads, no dropout."""
    out, lse = attention(
        q, k, v, mask, 0.0, kw.is_causal, kw.scale, True, strategy=kw.strategy,
        window=kw.window, return_lse=True, softcap=kw.softcap, sinks=sinks,
        cu_seqlens_q=kw.cu_seqlens,
    )  # fmt: skip
    return out, lse


def _local_dropout(
    kw: Keywords,
    dropout: Dropout,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, lse) of `attention` with ``dropout`` as drawn: `attngrad.call.eager`'s run with the
    call's (seed, offset) given instead of drawn.  q [1, h, N, d] (one batch entry)."""
    query, key, value, mask = autocast_inputs(q, k, v, mask)
    call = Call.build(
        query, key, value, mask, dropout.p, kw.is_causal, kw.scale, True, strategy=kw.strategy,
        window=kw.window, block_q=None, block_k=None, return_lse=True, softcap=kw.softcap,
        sinks=sinks, align="top-left", cu_seqlens_q=kw.cu_seqlens, cu_seqlens_k=None,
        generator=None,
    )  # fmt: skip
    qc, kc, vc = call.inputs(query, key, value)
    with outside_autocast(qc.device.type):
        strategy = REGISTRY[call.strategy]
        band = call.band.build(call.shapes.seq_q, call.shapes.seq_k, qc.device)
        problem = Problem(qc, kc, vc, call.score_mods(band, dropout), call.scale,
                          call.tiles(strategy, qc))  # fmt: skip
        o, lse, _ = differentiable(strategy, problem)
    out, lse = call.outputs(o, lse)
    return out, lse


def _pick(x: torch.Tensor | None, b: int, h: slice) -> torch.Tensor | None:
    """Batch entry b and heads h of a rows-form x [Bx, Hx, ...] (a broadcast dim stays)."""
    if x is None:
        return None
    x = x[b : b + 1] if x.shape[0] > 1 else x
    return x[:, h] if x.shape[1] > 1 else x


def _attend(
    kw: Keywords,
    dropout: Dropout | None,
    head0: int,
    heads_q: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hl, N, dv], lse [B, Hl, N]) over this rank's heads, global head ``head0`` on of
    ``heads_q``; with dropout in blocks of heads that draw the gathered call's mask."""
    if dropout is None:
        return _local(kw, q, k, v, mask, sinks)
    b, hl = q.shape[:2]
    g = hl // k.shape[1]
    outs, lses = [], []
    for i in range(b):  # each entry's blocks: their sizes follow its first global head
        entry_o, entry_lse = [], []
        for h0, h1 in head_blocks(i * heads_q + head0, hl, g):
            kh = slice(h0 // g, max(h1 // g, h0 // g + 1))
            o, lse = _local_dropout(
                kw, retarget(dropout, i * heads_q + head0 + h0), q[i : i + 1, h0:h1],
                k[i : i + 1, kh], v[i : i + 1, kh], _pick(mask, i, slice(h0, h1)),
                _pick(sinks, i, slice(h0, h1)),
            )  # fmt: skip
            entry_o.append(o)
            entry_lse.append(lse)
        outs.append(torch.cat(entry_o, 1))
        lses.append(torch.cat(entry_lse, 1))
    return torch.cat(outs), torch.cat(lses)


def all_to_all_attention(
    comm: RingComm,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shapes: Shapes,
    settings: Settings,
    kw: Keywords,
    attn_mask: torch.Tensor | None,
    sink: torch.Tensor | None,
    generator: torch.Generator | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [*lead, Hq, n, dv], lse [*lead, Hq, n] or None) of this rank's shard.

    q, k, v as the caller passed them (validated, ``shapes``); ``sink`` validated
    (`attngrad.core.keywords.validate_sinks`).  The settings are checked across the
    ranks first (``settings``), then the heads' divisibility.
    """
    p, layout = comm.world, settings.layout
    mask = shard_mask(attn_mask, q, shapes, p, settings.is_causal)
    sinks = sinks_form(sink, shapes)
    wants = [n for n, t in zip("qkv", (q, k, v), strict=True) if t.requires_grad]
    wants += ["attn_mask"] if mask is not None and mask.requires_grad else []
    wants += ["sinks"] if sinks is not None and sinks.requires_grad else []
    settings = replace(
        settings,
        mask=() if mask is None else (tensor_kind(mask), *mask.shape),
        sinks=sinks_of(sinks),
        requires_grad=tuple(wants) if torch.is_grad_enabled() else (),
    )
    check_same_shards(comm, q, shapes, settings)
    check_heads(shapes, p)
    dropout = shared_dropout(comm, settings.dropout_p, q.device, generator)
    hq, n = shapes.heads_q, shapes.seq_q

    def local(
        ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask_l = None if mask is None else _to_heads(mask, comm, layout, hq, n)  # (Bm, Hm', Nm, Nk)
        sinks_l = None if sinks is None else _to_heads(sinks, comm, layout, hq, n)[..., 0]
        return _attend(kw, dropout, comm.rank * (hq // p), hq, ql, kl, vl, mask_l, sinks_l)

    return over_heads(comm, layout, shapes, q, k, v, local, return_lse)


Local = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def over_heads(
    comm: RingComm,
    layout: str,
    shapes: Shapes,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    local: Local,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scheme's frame: q, k, v traded to the rank's heads, ``local`` run there, its
    (O, lse) traded back.

    q: [*lead, Hq, n, d], k, v: [*lead, Hkv, n, d|dv] (this rank's shards, ``shapes``);
    ``local(ql, kl, vl)`` takes ql: [B, Hq/P, N, d], kl, vl: [B, Hkv/P, N, d|dv] (heads
    rank * H/P on, every position in the true order) and returns (O [B, Hq/P, N, dv],
    lse [B, Hq/P, N]); it may run collectives of its own, alike on every rank.  Returns
    (out [*lead, Hq, n, dv], lse [*lead, Hq, n] or None).
    """
    b, n, hq, hkv = shapes.batch, shapes.seq_q, shapes.heads_q, shapes.heads_kv
    qb = q.reshape(b, hq, n, shapes.head_dim)  # (B, Hq, n, d)
    kb = k.reshape(b, hkv, n, shapes.head_dim)  # (B, Hkv, n, d)
    vb = v.reshape(b, hkv, n, shapes.value_dim)  # (B, Hkv, n, dv)
    to_heads = Trade(comm, layout, SEQ_TO_HEADS)
    ql, kl, vl = _trade(to_heads, qb, kb, vb)  # (B, Hq/P, N, d), (B, Hkv/P, N, d|dv)
    o, lse = local(ql, kl, vl)
    back = Trade(comm, layout, HEADS_TO_SEQ)
    if return_lse:  # one trade of both: backward runs it when either is used
        out, lse_ = _trade(back, o, lse.unsqueeze(-1))
        return out.reshape(shapes.out_shape), lse_.reshape(shapes.lse_shape)
    (out,) = _trade(back, o)
    return out.reshape(shapes.out_shape), None


# -- packed documents ------------------------------------------------------------------------


def packed_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    timeout: float = DEFAULT_TIMEOUT,
    strategy: str = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    sinks: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention(..., scheme="all_to_all")`` over packed documents.

    q: [..., Hq, N/P, d], k, v: [..., Hkv, N/P, d|dv] as for `attngrad.ring_attention`;
    ``cu_seqlens``: the documents' cumulative lengths over the *full* sequence, [0, ...,
    N] (1-D int), the same tensor on every rank.  Query i attends the keys of its own
    document (causally with ``is_causal``, inside a ``window``): this rank's shard of
    ``attention(Q, K, V, cu_seqlens_q=cu_seqlens, ...)``.  The local call of the
    all-to-all scheme sees every position in the true order, so the documents pass to
    it unchanged (any layout), and its work is balanced whatever their lengths: each
    rank computes every document for H/P heads.  The other keywords are ring_attention's
    under "all_to_all"; ranks that pass different cu_seqlens raise ValueError on every
    rank.  Without a process group (or with one rank) this is `attngrad.attention`.
    """
    shapes = validate_attention(q, k, v, None, dropout_p, is_causal, scale, True)
    check_flag("return_lse", return_lse)
    sink = validate_sinks(sinks, q, shapes)
    generator = validate_generator(generator, q.device)
    window = validate_window(window)
    softcap = validate_softcap(softcap)
    validate_ring(shapes, layout, timeout, strategy, ("auto", *STRATEGIES),
                  "local call (packed_ring_attention)")  # fmt: skip
    if strategy != "auto":
        reason = unavailable_reason(strategy, q.device)
        if reason is not None:
            raise RuntimeError(reason)
    ring = process_group(group)
    if ring is None:
        return attention(
            q, k, v, None, dropout_p, is_causal, scale, True, strategy=strategy,
            window=window, return_lse=return_lse, softcap=softcap, sinks=sinks,
            cu_seqlens_q=cu_seqlens, generator=generator,
        )  # fmt: skip
    comm = RingComm(ring, float(timeout))
    full = replace(shapes, seq_q=shapes.seq_q * comm.world, seq_k=shapes.seq_k * comm.world)
    segments = validate_segments(cu_seqlens, None, full, q.device)
    assert segments is not None  # cu_seqlens is given
    s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    settings = Settings(is_causal, layout, s, float(dropout_p), "all_to_all", window, softcap,
                        documents=documents_of(segments[0]))  # fmt: skip
    kw = Keywords(is_causal, scale, strategy, window, softcap, cu_seqlens)
    out, lse = all_to_all_attention(
        comm, q, k, v, shapes, settings, kw, None, sink, generator, return_lse
    )
    return (out, lse) if lse is not None else out
