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

Backward (`attngrad.ring.backward`) runs the block kernel's backward on each
pair with the final statistics while k/v travel again and each block's dK/dV
travel with it home; each rank saves only its own q, k, v, O and statistics:
O(N/P) memory per rank.  The pairs, their problems and the two walks are
`attngrad.ring.blocks`'.

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

The keywords that act on scores are the block kernel's own, per block:

* ``window``: the band i - left <= j <= i + right in *global* positions
  becomes, for a block whose first row and key sit at global (q0, k0), the
  block's band shifted by q0 - k0 (`Ring.band`); a pair the band leaves
  empty is skipped (no compute; its k/v shard still travels).
* ``softcap``: the block kernel's score modification, unchanged.
* ``attn_mask`` [Bm, Hm, N/P, N]: rows cut like q, keys the whole sequence in
  true order; a block takes its rows and the columns of its keys' global
  positions (views), and its bias gradient goes into the same columns of
  dmask: the mask never travels.

Window, mask and dropout need each block's global origin, so their blocks
merge only where they stay contiguous in the sequence (`step_blocks`'s
``positional``).

Forward mode (`ring_tangent`): with the final statistics, P_b = exp(S_b - lse)
of every block is the softmax over all keys, so each block's forward-mode
pass gives (acc_b - mu_b O, mu_b), acc_b = (P_b * S'_b) v_b + P_b v'_b and
mu_b = rowsum(P_b * S'_b), linear in the blocks' shares: their sums over a
ring that carries k' and v' with k and v are (O', lse').

Double backward (`attngrad.ring.second`): under ``create_graph=True``,
`RingAttention`'s backward is `RingGradients`, the same first-order ring as a
Function whose backward is a second-order pass around the ring, O(N/P) per rank.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from attngrad.api import attention
from attngrad.autograd.linearized import Terminal
from attngrad.autograd.tangent import output_tangent
from attngrad.core.band import validate_window
from attngrad.core.contract import (
    ArgumentError,
    ArgumentTypeError,
    check_flag,
    validate_attention,
)
from attngrad.core.keywords import validate_generator, validate_sinks, validate_softcap
from attngrad.core.ops import compute_dtype, log_normalizer, lse
from attngrad.core.sinks import merge_sinks
from attngrad.ring.all_to_all import Keywords, all_to_all_attention, sinks_form, sinks_of
from attngrad.ring.backward import ring_gradients
from attngrad.ring.blocks import (
    BLOCK_STRATEGIES,
    Ring,
    Tensors,
    Travel,
    block_pair,
    block_problem,
    build_pairs,
    circulate,
    mask_block,
    masked_out,
    rows_of,
)
from attngrad.ring.checks import (
    Settings,
    check_same_shards,
    shard_mask,
    tensor_kind,
    validate_ring,
    validate_scheme,
)
from attngrad.ring.comm import DEFAULT_TIMEOUT, RingComm, shared_dropout
from attngrad.ring.flex_pairs import FlexPairs
from attngrad.ring.layout import Block
from attngrad.ring.second import RingGradients
from attngrad.strategies import REGISTRY, STRATEGIES, tiled_default, unavailable_reason

__all__ = ["BLOCK_STRATEGIES", "merge_partial_", "ring_attention"]

_NEG_INF = float("-inf")


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


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, n, dv] (input dtype) and stats: [B, Hq, n, 2] of this rank's queries over all keys.

    q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv], contiguous; n = N / P.
    mask: (bias, keep), each [Bm, Hm, nm, Nkm] (nm 1 or n, Nkm 1 or N) or None.
    captured: the score_mod's tensors (``ring.flex``), in `FlexPairs.keys`'s order.
    """
    b, hq, n, _ = q.shape
    dtype = compute_dtype(q.dtype)
    shape = torch.Size((b, hq, n, v.shape[-1]))
    o = torch.zeros(shape, dtype=dtype, device=q.device)
    stats = torch.zeros((b, hq, n, 2), dtype=dtype, device=q.device)
    stats[..., 1] = float("inf")  # no key seen yet: l = 0 (a row no pair reaches stays O = 0)
    first = [True]  # no partial merged yet

    def merge(blocks: list[Block], shards: Tensors) -> None:
        for blk in blocks:
            problem = block_problem(
                ring, blk, q, shards[0], shards[1], scale, mask, captured=captured
            )
            if problem is None:
                continue
            o_b, saved = ring.strategy.forward(problem)
            if first[0] and o_b.shape == shape:  # a first partial over every row: O itself
                o.copy_(o_b)
                stats.copy_(saved["stats"])
            else:
                merge_partial_(rows_of(o, blk.rows), rows_of(stats, blk.rows), o_b, saved["stats"])
            first[0] = False

    circulate(ring, n, (k, v), merge)
    return o.to(q.dtype), stats


# -- forward mode: the tangents of O and lse, one more ring ------------------------


def ring_tangent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    stats: torch.Tensor,
    tangents: tuple[torch.Tensor | None, ...],
    ring: Ring,
    scale: float,
    mask: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O' [B, Hq, n, dv] in the input dtype, lse' [B, Hq, n] in the compute dtype) of this
    rank's rows, along tangents (q', k', v', bias', *captured') (None: zero), shapes as
    their inputs (captured: the score_mod's tensors, as in `ring_forward`).

    With the final statistics known, each block's P = exp(S - lse) is already the
    softmax over every key (`attngrad.autograd.tangent`), so the block kernel's
    forward mode run on the block against the final O and stats returns
    (acc_b - mu_b O, mu_b), acc_b = (P * S') v + P v' and mu_b = rowsum(P * S') its
    keys' shares; both are linear in the shares, so their sum over blocks is
    (O', lse').  k' and v' travel with k and v where some rank has them
    (`Travel`): one ring of P - 1 steps, O(N/P) memory.
    """
    t_q, t_k, t_v, t_bias, *t_captured = tangents
    dtype = compute_dtype(q.dtype)
    moving = ring.comm.any((t_k is not None, t_v is not None), q.device,
                           "agreeing on the tangents that travel")  # fmt: skip
    travel = Travel.of(k, v, t_k, t_v, moving)
    t_o = torch.zeros(o.shape, dtype=dtype, device=q.device)
    t_lse = torch.zeros(stats.shape[:-1], dtype=dtype, device=q.device)

    def add_shares(blocks: list[Block], shards: Tensors) -> None:
        kc, vc = shards[:2]
        tkc, tvc = travel.directions(shards)
        for blk in blocks:
            problem = block_problem(ring, blk, q, kc, vc, scale, mask, captured=captured)
            if problem is None:
                continue
            final = {"o": rows_of(o, blk.rows), "stats": rows_of(stats, blk.rows)}
            pair = block_pair(ring, blk, problem.q, problem.k, problem.v)
            moved = (
                None if t_q is None else rows_of(t_q, blk.rows),
                None if tkc is None else rows_of(tkc, blk.cols),
                None if tvc is None else rows_of(tvc, blk.cols),
                mask_block(t_bias, blk),
                *(() if pair is None else pair.pick(tuple(t_captured))),
            )
            do_b, dlse_b = output_tangent(ring.strategy, problem, final, moved, final["o"])
            rows_of(t_o, blk.rows).add_(do_b)
            rows_of(t_lse, blk.rows).add_(dlse_b)

    circulate(ring, q.shape[2], travel.tensors, add_shares)
    return t_o.to(q.dtype), t_lse


class RingAttention(torch.autograd.Function):
    """autograd.Function over this rank's q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv],
    the mask's (bias, keep) [Bm, Hm, nm, Nkm] (or None) and a score_mod's captured tensors.

    RingAttention.apply(q, k, v, bias, keep, ring, scale, *captured) -> (O, lse, stats),
    stats non-differentiable (returned so that torch.func may save it).  Backward: the
    first-order ring (`attngrad.ring.backward`, O(N/P)); under ``create_graph=True`` the
    same as `attngrad.ring.second.RingGradients`, whose backward is the second-order
    ring (O(N/P)).  jvp: `ring_tangent`.  A captured tensor's gradient is this rank's share (its rows'
    scores'): the caller sums it over the ranks.
    """

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        ring: Ring,
        scale: float,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o, stats = ring_forward(q, k, v, ring, scale, (bias, keep), captured)
        return o, lse(stats), stats

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, keep, ring, scale, *captured = inputs
        o, _, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, bias, keep, o, stats, *captured)
        ctx.save_for_forward(q, k, v, bias, keep, o, stats, *captured)
        ctx.ring, ctx.scale = ring, scale
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, _: object
    ) -> tuple[torch.Tensor | None, ...]:
        if dout is None and dlse is None:  # reached by none of its outputs
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, bias, keep, o, stats, *captured = ctx.saved_tensors
        need = (*ctx.needs_input_grad[:4], *ctx.needs_input_grad[7:])
        # O enters the gradients as a constant: their derivatives through it come by q, k, v
        tensors = (dout, dlse, q, k, v, bias, keep, o.detach(), stats)
        if torch.is_grad_enabled():  # create_graph=True: the gradients will be differentiated
            grads = RingGradients.apply(ctx.ring, ctx.scale, need, *tensors, *captured)  # type: ignore[no-untyped-call]
        else:
            grads = ring_gradients(ctx.ring, ctx.scale, *tensors, tuple(captured), need)
        dq, dk, dv, dbias, *dcaptured = grads
        return dq, dk, dv, dbias, None, None, None, *dcaptured

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        moved = (*tangents[:4], *tangents[7:])
        with torch.no_grad():  # under a reverse pass too (forward over reverse): not recorded
            t_o, t_lse = RingTangent.apply(ctx.ring, ctx.scale, *moved, *ctx.saved_tensors)  # type: ignore[no-untyped-call]
        return t_o, t_lse, None


class RingTangent(Terminal):
    """`ring_tangent` as a Function that is not differentiated again.

    RingTangent.apply(ring, scale, q', k', v', bias', *captured', q, k, v, bias, keep, o,
    stats, *captured) -> (O', lse'), as `ring_tangent` returns them.  Under
    ``torch.func.jvp`` `RingAttention.jvp` runs at the transform's level, on its wrappers,
    where the score_mod's tangent (autograd on a tile) cannot run; a Function's forward
    runs below it, on plain tensors."""

    MISSING = (
        "reverse mode over ring attention's forward mode is not implemented: for second "
        "derivatives take forward over reverse or create_graph=True."
    )

    @staticmethod
    def forward(ring: Ring, scale: float, *args: torch.Tensor | None) -> Any:
        n = (len(args) - 3) // 2  # 4 + n_captured tangents, 7 + n_captured tensors
        q, k, v, bias, keep, o, stats, *captured = args[n:]
        assert q is not None and k is not None and v is not None
        assert o is not None and stats is not None
        return ring_tangent(
            q,
            k,
            v,
            o,
            stats,
            args[:n],
            ring,
            scale,
            (bias, keep),
            tuple(captured),  # type: ignore[arg-type]
        )


def flex_over_ring(
    comm: RingComm,
    layout: str,
    strategy: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pairs: FlexPairs,
    captured: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, Hq, n, dv], lse [B, Hq, n]) of `attngrad.ring.flex_ring_attention`'s scheme="ring":
    this rank's q: [B, Hq, n, d] against every rank's k: [B, Hkv, n, d], v: [B, Hkv, n, dv]
    around the ring, each pair with ``pairs``' score_mod and BlockMask (skipped where it
    leaves the pair empty); ``captured``: the score_mod's tensors, in ``pairs.keys``'s
    order (their gradients are this rank's shares).  Checked by the caller."""
    ring = Ring(comm, layout, False, REGISTRY[strategy], flex=pairs)
    k, v = k.contiguous(), v.contiguous()
    build_pairs(ring, q, k, v)
    o, lse_, _ = RingAttention.apply(q, k, v, None, None, ring, scale, *captured)  # type: ignore[no-untyped-call]
    return o, lse_


# -- the public call ----------------------------------------------------------------


def _ring_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` (None: the default one), or None when there is no ring to run over:
    no initialised process group, or a group of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


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
    score_mod: Any = None,
    block_mask: Any = None,
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
    (`attngrad.ring.attention`), with every keyword below but no
    ``strategy`` beyond the tiled ones.  ``"all_to_all"`` (DeepSpeed-Ulysses): an
    all-to-all trades the sequence shards for whole sequences of H/P heads
    per rank, plain `attngrad.attention` runs on them with any strategy
    (``strategy``, default "auto") and every keyword, and a second all-to-all
    trades the output back (`attngrad.ring.all_to_all`); Hq and Hkv must
    divide by P; it also takes every strategy and ``torch.func.vmap``.

    Derivatives, under both schemes: backward; double backward
    (``create_graph=True``, e.g. a gradient penalty); forward mode
    (``torch.autograd.forward_ad`` and ``torch.func.jvp``: each rank passes
    its shards' tangents and gets its rows' tangents of out and lse);
    ``torch.func.grad``, ``vjp`` and their compositions (jvp of grad, grad of
    grad).  torch.func's vmap-based transforms (vmap, jacrev, jacfwd, hessian)
    run under "all_to_all" only.  Under
    "ring" first-order backward and forward mode are rings of their own at
    O(N/P) memory per rank (forward mode sends k' and v' beside k and v);
    under ``create_graph=True`` the gradients' own backward is a second-order
    pass around the ring (`attngrad.ring.second`), O(N/P) per rank too.
    Every rank must take the same derivatives (``create_graph`` alike).
    Third derivatives raise.

    ``attn_mask``: bool (True = attend) or float (added to the scores, its
    gradient returned), the rows of this rank's shard against every key:
    broadcastable to [..., Hq, N/P, N], keys in the sequence's true order --
    ``shard(mask, rank, P, layout)`` of the full [..., N, N] mask; its
    gradient is this rank's rows'.  Under "ring" a pair of chunks the mask
    keeps no score of (all False, or all -inf; a bias at finfo.min keeps its
    scores) is skipped.  Not with ``is_causal`` (as in
    `attngrad.attention`; ``window=(None, 0)`` is causal and takes a mask).
    ``window=(left, right)``: query i attends keys i - left .. i + right in
    global positions; under "ring" each (query chunk, key chunk) pair takes
    the band at the pair's global offset, and pairs it leaves empty are
    skipped (the k/v shard still travels).  ``softcap``: scores capped to
    c tanh(S / c) before the mask, as in `attngrad.attention`.

    ``timeout``: seconds a rank waits on its peers at each step before it
    raises `attngrad.ring.RingTimeoutError` (a peer died, hangs or never
    called).  ``strategy``: under "ring" the per-block kernel, one of
    `BLOCK_STRATEGIES` (None: triton on CUDA when Triton is installed, fused on
    CPU where its kernels build, else flash: `attngrad.strategies.tiled_default`);
    under "all_to_all" any of `attngrad.STRATEGIES` or "auto".
    ``return_lse=True`` returns ``(out, lse)`` as `attngrad.attention` does:
    lse [..., Hq, N/P], this shard's rows' log-sum-exp over the full sequence.

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

    ``score_mod``, ``block_mask``: FlexAttention's, written for the full
    sequence (global positions and heads; the BlockMask built for [.., N, N]):
    the call is `attngrad.ring.flex_ring_attention`'s under either scheme
    (q, k, v 4-D).  As in `attngrad.flex_attention` they take the place of
    ``is_causal``, ``attn_mask``, ``window``, ``softcap``, ``sinks`` and
    dropout, which raise ValueError beside them (write them into the
    mask_mod or the score_mod).

    Shards of unequal length, or different shapes, dtypes or settings on
    different ranks, raise ValueError on every rank (checked with one small
    all_gather).  Backward is collective too: every rank that called forward
    must run it.
    """
    scheme = validate_scheme(scheme)
    if score_mod is not None or block_mask is not None:
        beside = {"is_causal": is_causal, "attn_mask": attn_mask, "window": window,
                  "softcap": softcap, "sinks": sinks, "dropout_p": dropout_p}  # fmt: skip
        given = [
            f"{name}=tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
            else f"{name}={value!r}"
            for name, value in beside.items()
            if isinstance(value, torch.Tensor) or value not in (None, False, 0.0)
        ]  # fmt: skip
        if given:
            raise ArgumentError(
                f"score_mod and block_mask take the place of is_causal, attn_mask, window, "
                f"softcap, sinks and dropout (as in attngrad.flex_attention), got "
                f"{', '.join(given)} beside them: write them into the BlockMask's mask_mod "
                "(causal: kv_idx <= q_idx; a window: q_idx - kv_idx <= left) or the score_mod "
                "(softcap: c * tanh(score / c))."
            )
        from attngrad.ring.flex import flex_ring_attention  # flex builds on this module

        return flex_ring_attention(  # type: ignore[no-any-return]
            q, k, v, score_mod, block_mask, group=group, scheme=scheme, layout=layout,
            scale=scale, enable_gqa=True, return_lse=return_lse, timeout=timeout,
            strategy="auto" if strategy is None else strategy,
        )  # fmt: skip
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
    mask = shard_mask(attn_mask, q, shapes, comm.world, is_causal)
    wants = [n for n, t in zip("qkv", (q, k, v), strict=True) if t.requires_grad]
    wants += ["attn_mask"] if mask is not None and mask.requires_grad else []
    wants += ["sinks"] if sink is not None and sink.requires_grad else []
    settings = replace(
        settings,
        mask=() if mask is None else (tensor_kind(mask), *mask.shape),
        sinks=sinks_of(sinks_form(sink, shapes)),
        # the second-order path's graph must be one on every rank
        requires_grad=tuple(wants) if torch.is_grad_enabled() else (),
    )
    check_same_shards(comm, q, shapes, settings)
    dropout = shared_dropout(comm, dropout_p, q.device, generator)
    n = shapes.seq_q
    b, hq, hkv = shapes.batch, shapes.heads_q, shapes.heads_kv
    qb = q.reshape(b, hq, n, shapes.head_dim)  # (B, Hq, n, d)
    # k/v are sent as they are: contiguous
    kb = k.reshape(b, hkv, n, shapes.head_dim).contiguous()  # (B, Hkv, n, d)
    vb = v.reshape(b, hkv, n, shapes.value_dim).contiguous()  # (B, Hkv, n, dv)
    ring = Ring(
        comm, layout, is_causal, REGISTRY[strategy], dropout, window, softcap, mask is not None
    )
    bias, keep = (None, mask) if mask is not None and mask.dtype == torch.bool else (mask, None)
    if mask is not None:
        ring = replace(ring, masked_out=masked_out(ring, n, (bias, keep)))
    o, lse_, _ = RingAttention.apply(qb, kb, vb, bias, keep, ring, s)  # type: ignore[no-untyped-call]
    out = o.reshape(*shapes.lead, hq, n, shapes.value_dim)
    lse_ = lse_.reshape(*shapes.lead, hq, n)
    if sink is not None:  # once per row, after every key's partial has been merged
        out, lse_ = merge_sinks(out, lse_, sink)
    out, lse_ = out.reshape(shapes.out_shape), lse_.reshape(shapes.lse_shape)  # headless: [n, ...]
    return (out, lse_) if return_lse else out
