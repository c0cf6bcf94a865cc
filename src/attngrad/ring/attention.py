r"""Ring attention: the k/v shards travel around the ranks, each rank keeps its queries.

Rank r holds q, k, v of its shard (N/P positions).  At step s = 0..P-1 it
holds the k/v shard of rank r - s (mod P), computes its queries against it
with the block kernel (flash's tiled forward by default) while sending that
shard on to rank r + 1 and receiving the next from rank r - 1, and merges the
partial result through its row statistics (m, log l) (see `attngrad.core.ops`):

    m = max(m_a, m_b)    w_a = l_a exp(m_a - m)    w_b = l_b exp(m_b - m)
    l = w_a + w_b        O = (O_a w_a + O_b w_b) / l     (weights / l <= 1: no overflow)

A partial whose rows attend nothing has l = 0 and weight 0; when both do,
the row stays O = 0, l = 0 (never NaN).

Backward needs, for each block, only P = exp((S - m) - log l) with the
*final* statistics, and Delta = rowsum(dO * O) with the *final* O:

    dV_blk = P^T dO    dS = P * (dO v_blk^T - Delta + dlse)    dq += s dS k_blk    dK_blk = s dS^T q

so the block kernel's backward runs unchanged on each (q shard, k/v block)
pair.  k/v travel the ring again, and each block's dK/dV travel with it,
collecting every rank's contribution, until they reach their owner.  Each
rank saves only its own q, k, v, O and statistics: O(N/P) memory per rank.

Dropout and sinks come out as in single-process `attngrad.attention`:

* dropout's mask Z is a hash of (seed, offset, b * Hq + h, global query
  position, global key position) (`attngrad.core.dropout`).  Every rank draws
  (seed, offset) from its generator, as `attention` does, and all take rank
  0's draw (one broadcast); each block's mask is shifted to the block's
  global origin (`attngrad.ring.layout`), so the block kernel draws exactly
  the bits of the gathered call.  The merge above is linear in the partial
  outputs, and (m, l) are those of the undropped softmax, so forward and
  backward need nothing else.  Backward then runs as one head group: Z
  hashes the call's head index, which a group's slice of the heads would
  renumber.
* a sink joins each row's denominator once, so it is merged after the ring,
  into the final (O, lse) (`attngrad.core.sinks.merge_sinks`), and its gradient
  comes from autograd through that merge: dlse reaches the ring's backward.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attngrad.api import attention
from attngrad.core.band import validate_window
from attngrad.core.contract import (
    ArgumentError,
    ArgumentTypeError,
    Shapes,
    check_flag,
    validate_attention,
)
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Backward, Problem, Strategy
from attngrad.core.keywords import validate_generator, validate_sinks, validate_softcap
from attngrad.core.ops import compute_dtype, log_normalizer, lse
from attngrad.core.sinks import merge_sinks
from attngrad.ring.all_to_all import Keywords, all_to_all_attention
from attngrad.ring.checks import Settings, check_same_shards, validate_ring, validate_scheme
from attngrad.ring.comm import DEFAULT_TIMEOUT, Exchange, RingComm, shared_dropout
from attngrad.ring.layout import Block, step_blocks
from attngrad.strategies import REGISTRY, STRATEGIES, TILED, tiled_default, unavailable_reason

__all__ = ["BLOCK_STRATEGIES", "merge_partial_", "ring_attention"]

_NEG_INF = float("-inf")


# -- the block kernel ---------------------------------------------------------

# The strategies that compute one block (a rank's query rows against one k/v
# block): the tiled ones, whose forward returns O and the row statistics and
# whose backward takes the rows' final O and statistics over every key.
BLOCK_STRATEGIES = TILED


# -- forward: partial outputs merged through their stats --------------------------


def _max_and_sum(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, l) from stats [..., r, 2]: m = -inf and l = 0 on a row that attends nothing."""
    m, log_l = stats.unbind(-1)
    dead = log_l == float("inf")
    return m.masked_fill(dead, _NEG_INF), torch.exp(log_l).masked_fill(dead, 0.0)


def merge_partial_(
    o: torch.Tensor, stats: torch.Tensor, o_b: torch.Tensor, stats_b: torch.Tensor
) -> None:
    """Merge the partial (o_b, stats_b) into (o, stats) in place (see the module docstring).

    o, o_b: [..., r, dv]; stats, stats_b: [..., r, 2].  o and stats are updated.
    """
    (m_a, l_a), (m_b, l_b) = _max_and_sum(stats), _max_and_sum(stats_b)
    m = torch.maximum(m_a, m_b)
    shift = m.masked_fill(m == _NEG_INF, 0.0)  # both parts dead: weights exp(-inf) = 0
    w_a, w_b = l_a * torch.exp(m_a - shift), l_b * torch.exp(m_b - shift)
    l_sum = w_a + w_b
    total = l_sum.masked_fill(l_sum == 0, 1.0)
    o.mul_((w_a / total).unsqueeze(-1)).addcmul_(o_b, (w_b / total).unsqueeze(-1))
    # a part of weight 0 leaves the other's statistics as they were, bit for bit
    log_a, log_b = (st[..., 1] + (st[..., 0] - shift) for st in (stats, stats_b))
    log_l = torch.where(w_b == 0, log_a, torch.where(w_a == 0, log_b, log_normalizer(l_sum)))
    stats.copy_(torch.stack((shift, log_l), dim=-1))


@dataclass(frozen=True)
class _Ring:
    """What forward and backward share: the comm, the layout, the block strategy, the dropout."""

    comm: RingComm
    layout: str
    is_causal: bool
    strategy: Strategy[Any]
    dropout: Dropout | None = None

    def steps(self, seq_local: int) -> list[list[Block]]:
        """The blocks of each step s, against the k/v shard of rank r - s."""
        rank, world = self.comm.rank, self.comm.world
        positional = self.dropout is not None  # blocks must keep their global origins
        return [
            step_blocks(
                rank, (rank - s) % world, world, self.layout, seq_local, self.is_causal, positional
            )
            for s in range(world)
        ]


def _rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    """t[:, :, s]: rows (dim 2) of a [B, H, N, ...] tensor; a view."""
    return t[:, :, s]


def _problem(
    ring: _Ring, blk: Block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> Problem[Any]:
    """The block kernel's problem: the block's rows of q against its k/v block, the block's
    mods (its band, the dropout at its global origin) and the strategy's tiles for it."""
    qb, kb, vb = _rows(q, blk.rows), _rows(k, blk.cols), _rows(v, blk.cols)
    tiles = ring.strategy.tiles(Shapes.of(qb, kb, vb), q.dtype, None, None)
    mods = blk.score_mods(k.shape[1], q.device, ring.dropout)
    return Problem(qb, kb, vb, mods, scale, tiles)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, n, dv] (input dtype) and stats: [B, Hq, n, 2] of this rank's queries over all keys.

    q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv], contiguous; n = N / P.
    """
    b, hq, n, _ = q.shape
    dtype = compute_dtype(q.dtype)
    shape = torch.Size((b, hq, n, v.shape[-1]))
    o: torch.Tensor | None = None
    stats = torch.zeros((b, hq, n, 2), dtype=dtype, device=q.device)
    stats[..., 1] = float("inf")  # no key seen yet: l = 0
    steps = ring.steps(n)
    kc, vc = k, v
    for s, blocks in enumerate(steps):
        incoming = ring.comm.send_recv((kc, vc)) if s + 1 < len(steps) else None
        for blk in blocks:
            o_b, saved = ring.strategy.forward(_problem(ring, blk, q, kc, vc, scale))
            stats_b = saved["stats"]
            if o is None and o_b.shape == shape:  # a first partial over every row: O itself
                o, stats = o_b.to(dtype), stats_b
            else:
                o = o if o is not None else torch.zeros(shape, dtype=dtype, device=q.device)
                merge_partial_(_rows(o, blk.rows), _rows(stats, blk.rows), o_b, stats_b)
        if incoming is not None:
            kc, vc = incoming.wait()
    assert o is not None  # step 0 always has the own (diagonal) block
    return o.to(q.dtype), stats


# -- backward: dK/dV travel with their k/v block ---------------------------------


# Backward runs one ring per group of kv heads (at most this many groups): the
# buffers a rank holds for the ring (a remote k/v shard, its dK/dV accumulators)
# then cover only that group's heads, while the outputs stay whole.  With
# dropout one group: its mask hashes each head's index among all Hq.
HEAD_GROUPS = 4


@dataclass(frozen=True)
class _Shard:
    """This rank's tensors of one backward, shapes as in `ring_forward`: q, k, v, the
    final O and stats of its rows, dout [B, Hq, n, dv] and dlse [B, Hq, n], lse's
    cotangent (None: lse unused)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    stats: torch.Tensor
    dout: torch.Tensor
    dlse: torch.Tensor | None

    def heads(self, qh: slice, kh: slice) -> _Shard:
        """The query heads ``qh`` and their kv heads ``kh`` (k, v made contiguous: they travel)."""
        return _Shard(
            self.q[:, qh], self.k[:, kh].contiguous(), self.v[:, kh].contiguous(), self.o[:, qh],
            self.stats[:, qh], self.dout[:, qh], None if self.dlse is None else self.dlse[:, qh],
        )  # fmt: skip


def ring_backward(
    shard: _Shard, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shard (input dtype).

    The kv heads are cut into up to `HEAD_GROUPS` groups (a GQA group's query
    heads go with their kv head) and each group's gradients come from a ring
    pass of their own, `_ring_backward_group`: same messages in total, each
    1/HEAD_GROUPS the size, so the ring's buffers shrink by that factor.
    With dropout, one group of all heads (module docstring).
    """
    q, k = shard.q, shard.k
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(shard.v)
    groups = 1 if ring.dropout is not None else min(hkv, HEAD_GROUPS)
    bounds = [hkv * i // groups for i in range(groups + 1)]
    for h0, h1 in itertools.pairwise(bounds):
        qh, kh = slice(h0 * g, h1 * g), slice(h0, h1)
        dk[:, kh], dv[:, kh] = _ring_backward_group(dq[:, qh], shard.heads(qh, kh), ring, scale)
    return dq.to(q.dtype), dk, dv


def _ring_backward_group(
    dq: torch.Tensor, shard: _Shard, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring pass for a group of heads: adds into ``dq``, returns this shard's dk, dv.

    The k/v shards travel the ring again.  At step s = 1 .. P-1 the shard of
    rank r - s arrives (and goes on to r + 1 while this rank computes); its
    dK/dV accumulators arrive from rank r - 1 holding the shares of ranks
    r - s + 1 .. r - 1 (zeros at s = 1), this rank adds its share into them
    and passes them on.  After step P-1 the own shard's accumulators come
    back holding every other rank's share, and the own block's share goes
    into them last: P - 1 sends of k/v and P - 1 of dK/dV per rank, and no
    rank keeps a second set of dK/dV buffers while the others travel.
    dk, dv come back in the compute dtype.
    """
    q, k, v, o, stats, dout, dlse = (
        shard.q,
        shard.k,
        shard.v,
        shard.o,
        shard.stats,
        shard.dout,
        shard.dlse,
    )
    dtype = compute_dtype(q.dtype)
    steps = ring.steps(q.shape[2])

    def add_share(blocks: list[Block], kc: torch.Tensor, vc: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor) -> None:  # fmt: skip
        for blk in blocks:
            grads = (_rows(dq, blk.rows), _rows(dk, blk.cols), _rows(dv, blk.cols), None)
            final = {"o": _rows(o, blk.rows), "stats": _rows(stats, blk.rows)}
            dlse_b = None if dlse is None else _rows(dlse, blk.rows)
            problem = _problem(ring, blk, q, kc, vc, scale)
            ring.strategy.backward_into(
                Backward(problem, final, _rows(dout, blk.rows), dlse_b, grads)
            )

    incoming: Exchange | None = ring.comm.send_recv((k, v))
    travelling: Exchange | None = None  # the accumulators of the shard about to arrive
    for s in range(1, len(steps)):
        assert incoming is not None  # posted at the step before
        kc, vc = incoming.wait()
        incoming = ring.comm.send_recv((kc, vc)) if s + 1 < len(steps) else None
        if travelling is None:
            dk = torch.zeros(kc.shape, dtype=dtype, device=q.device)
            dv = torch.zeros(vc.shape, dtype=dtype, device=q.device)
        else:
            dk, dv = travelling.wait()
        add_share(steps[s], kc, vc, dk, dv)
        del kc, vc
        travelling = ring.comm.send_recv((dk, dv))
        del dk, dv
    assert travelling is not None  # P >= 2: at least one remote step
    dk_own, dv_own = travelling.wait()
    del travelling
    add_share(steps[0], k, v, dk_own, dv_own)
    return dk_own, dv_own


class RingAttention(torch.autograd.Function):
    """autograd.Function over this rank's q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv].

    Returns (O, lse).  First order only: its backward is a ring of its own.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: _Ring,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, stats = ring_forward(q, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, o, stats)
        ctx.ring, ctx.scale = ring, scale
        ctx.set_materialize_grads(False)
        return o, lse(stats)

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: the gradients would be differentiated
            raise NotImplementedError(
                "ring_attention has no double backward: its gradients cannot be differentiated "
                "again (create_graph=True, e.g. a gradient penalty). attngrad.attention has "
                "double backward on every strategy (at O(N) memory with strategy='flash'); "
                "use it on the gathered sequence for that."
            )
        q, k, v, o, stats = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(o)
        dq, dk, dv = ring_backward(_Shard(q, k, v, o, stats, dout, dlse), ctx.ring, ctx.scale)
        return dq, dk, dv, None, None


# -- the public call ----------------------------------------------------------------


def _ring_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` (None: the default one), or None when there is no ring to run over:
    no initialised process group, or a group of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _refuse_on_ring(scheme: str, **given: object) -> None:
    """ValueError naming the keywords the ring scheme does not take yet (issue 40)."""
    names = [name for name, value in given.items() if value is not None]
    if scheme == "ring" and names:
        raise ArgumentError(
            f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not supported by "
            "scheme='ring' yet (it takes is_causal, scale, dropout and sinks); pass "
            "scheme='all_to_all', which runs attngrad.attention over whole sequences of "
            "H/P heads per rank and takes every keyword."
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    timeout: float = DEFAULT_TIMEOUT,
    strategy: str | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    sinks: torch.Tensor | None = None,
    scheme: str = "ring",
    attn_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention over a sequence sharded across the ranks of ``group``; each rank passes its shard.

    q: [..., Hq, N/P, d], k: [..., Hkv, N/P, d], v: [..., Hkv, N/P, dv] -> [..., Hq, N/P, dv],
    this rank's shard of the output of ``attention(Q, K, V, is_causal=...,
    scale=..., enable_gqa=True)`` over the full sequence (Hq a multiple of Hkv;
    k and v are never expanded).  ``layout`` says which positions the shard
    holds (`attngrad.ring.shard` cuts them): ``"contiguous"`` (rank r: chunk r
    of P) or ``"zigzag"`` (rank r: chunks r and 2P-1-r of 2P, which balances
    ``is_causal`` work).  ``group``: the process group (None: the default
    one); without an initialised process group, or with one rank, this is
    plain `attngrad.attention`.

    ``scheme``: how the ranks share the work.  ``"ring"`` (the default): each
    rank keeps its queries and the k/v shards travel around the ranks
    (`attngrad.ring.attention`); first order only, and is_causal, scale,
    dropout and sinks only.  ``"all_to_all"`` (DeepSpeed-Ulysses): an
    all-to-all trades the sequence shards for whole sequences of H/P heads
    per rank, plain `attngrad.attention` runs on them with any strategy
    (``strategy``, default "auto") and every keyword, and a second all-to-all
    trades the output back (`attngrad.ring.all_to_all`); Hq and Hkv must
    divide by P.  Every derivative carries over: double backward
    (``create_graph=True``), forward mode (``torch.autograd.forward_ad``,
    ``torch.func.jvp``) and ``torch.func.vmap`` (every rank vmapping alike).
    Its keywords beyond the ring's: ``attn_mask`` (bool or float, the rows of
    this rank's shard against every key: broadcastable to [..., Hq, N/P, N],
    keys in the true order -- ``shard(mask, rank, P, layout)`` of the full
    [..., N, N] mask; its gradient is this rank's rows'), ``window`` and
    ``softcap`` as in `attngrad.attention`.

    ``timeout``: seconds a rank waits on its peers at each step before it
    raises `attngrad.ring.RingTimeoutError` (a peer died, hangs or never
    called).  ``strategy``: under "ring" the per-block kernel, one of
    `BLOCK_STRATEGIES` (None: triton on CUDA when Triton is installed, else
    flash); under "all_to_all" any of `attngrad.STRATEGIES` or "auto".
    ``return_lse=True`` returns ``(out, lse)`` as `attngrad.attention` does:
    lse [..., Hq, N/P], this shard's rows' log-sum-exp over the full sequence.
    Under "ring", first order only: ``create_graph=True`` raises NotImplementedError.

    ``dropout_p``, ``generator``: attention dropout as in `attngrad.attention`,
    with the mask of the gathered call: every rank draws (seed, offset) from
    ``generator`` (None: its device's default generator), which advances it
    as `attention`'s draw would, and all ranks use rank 0's draw (one
    broadcast).  So under ``torch.manual_seed(s)`` (or a generator seeded s)
    the result is this rank's shard of ``attention(Q, K, V, dropout_p=p,
    ...)`` under the same seed, however the other ranks are seeded.

    ``sinks``: as in `attngrad.attention`, [Hq] (one logit per head) or
    broadcastable to [..., Hq, N/P] (per token: this rank's rows; cut a
    [..., Hq, N] one with ``shard(s.unsqueeze(-1), rank, P, layout).squeeze(-1)``).
    The gradient a rank gets for a per-head (or any row-shared) ``sinks`` is
    its own share: for a sink parameter shared by the ranks, sum its ``.grad``
    over ``group`` (``dist.all_reduce``), as for any parameter replicated
    across them; a per-token one's is its rows'.  The same holds for an
    ``attn_mask`` shared by the rows.

    Shards of unequal length, or different shapes, dtypes or settings on
    different ranks, raise ValueError on every rank (checked with one small
    all_gather).  Backward is collective too: every rank that called forward
    must run it.
    """
    scheme = validate_scheme(scheme)
    _refuse_on_ring(scheme, attn_mask=attn_mask, window=window, softcap=softcap)
    shapes = validate_attention(q, k, v, None, dropout_p, is_causal, scale, True)
    check_flag("return_lse", return_lse)
    sink = validate_sinks(sinks, q, shapes)
    generator = validate_generator(generator, q.device)
    window = validate_window(window)
    softcap = validate_softcap(softcap)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), "
            f"got {type(group).__name__}; make one with dist.new_group(ranks)."
        )
    if scheme == "all_to_all":
        strategy = "auto" if strategy is None else strategy
        validate_ring(
            shapes,
            layout,
            timeout,
            strategy,
            ("auto", *STRATEGIES),
            "local call (scheme='all_to_all')",
        )
    else:
        if strategy is None:
            strategy = tiled_default(q.device, shapes.head_dim, shapes.value_dim)
        validate_ring(shapes, layout, timeout, strategy, BLOCK_STRATEGIES)
    if strategy != "auto":
        reason = unavailable_reason(strategy, q.device)
        if reason is not None:
            raise RuntimeError(reason)
    if scheme == "ring":  # ValueError for sizes it cannot take
        REGISTRY[strategy].tiles(shapes, q.dtype, None, None)
    ring_group = _ring_group(group)
    if ring_group is None:
        return attention(
            q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=True, strategy=strategy, return_lse=return_lse, sinks=sinks,
            generator=generator, window=window, softcap=softcap,
        )  # fmt: skip
    s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    comm = RingComm(ring_group, float(timeout))
    settings = Settings(is_causal, layout, s, float(dropout_p), scheme, window, softcap)
    if scheme == "all_to_all":
        kw = Keywords(is_causal, scale, strategy, window, softcap)
        out, lse_a = all_to_all_attention(
            comm, q, k, v, shapes, settings, kw, attn_mask, sink, generator, return_lse
        )
        return (out, lse_a) if lse_a is not None else out
    check_same_shards(comm, q, shapes, settings)
    dropout = shared_dropout(comm, dropout_p, q.device, generator)
    n = shapes.seq_q
    b, hq, hkv = shapes.batch, shapes.heads_q, shapes.heads_kv
    qb = q.reshape(b, hq, n, shapes.head_dim)  # (B, Hq, n, d)
    # k/v are sent as they are: contiguous
    kb = k.reshape(b, hkv, n, shapes.head_dim).contiguous()  # (B, Hkv, n, d)
    vb = v.reshape(b, hkv, n, shapes.value_dim).contiguous()  # (B, Hkv, n, dv)
    ring = _Ring(comm, layout, is_causal, REGISTRY[strategy], dropout)
    o, lse_ = RingAttention.apply(qb, kb, vb, ring, s)  # type: ignore[no-untyped-call]
    out = o.reshape(*shapes.lead, hq, n, shapes.value_dim)
    lse_ = lse_.reshape(*shapes.lead, hq, n)
    if sink is not None:  # once per row, after every key's partial has been merged
        out, lse_ = merge_sinks(out, lse_, sink)
    out, lse_ = out.reshape(shapes.out_shape), lse_.reshape(shapes.lse_shape)  # headless: [n, ...]
    return (out, lse_) if return_lse else out
