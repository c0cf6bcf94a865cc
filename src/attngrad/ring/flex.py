r"""FlexAttention over a sharded sequence: ``score_mod`` and ``BlockMask`` in both schemes.

scheme="all_to_all" (the default).  `flex_ring_attention` runs
`attngrad.flex_attention` in the all-to-all scheme
(`attngrad.ring.all_to_all`): rank r trades its sequence shard of every head
for all N positions of heads r H/P .. (r+1) H/P - 1, calls flex_attention
there, and trades the output back.  The local call covers the whole sequence
in its true order (whatever the layout), so a score_mod and a mask_mod see
the positions of the gathered call as they are; only the head index differs:
the local call numbers its heads from 0.  So each rank calls them through a
wrapper that adds its first global head,

    score_mod_r(s, b, h, i, j) = score_mod(s, b, h + r H/P, i, j)
    mask_mod_r(b, h, i, j)     = mask_mod(b, h + r H/P, i, j)

(a Python int baked in: the wrapper stays elementwise, fused's score and mask
programs trace it as HEAD + CONST), and a BlockMask built for the full
sequence with one entry per query head is sliced to the rank's heads (one
shared by the heads stays whole).  Rank 0's offset is 0: it calls the
functions themselves.

The compiled programs (`attngrad.core.score_program`), the BlockMask's band
(`attngrad.core.block_table`) and the local BlockMask are found once per
function or BlockMask and kept across calls, so the wrappers are too: one per
(function, offset) (`attngrad.ring.shifted`).  The local BlockMask is kept per
(BlockMask, heads) in a table keyed weakly by the BlockMask, rebuilt when its
mask_mod or block lists are replaced.

scheme="ring".  Each rank keeps its rows and every head; the k/v shards travel
around the ring (`attngrad.ring.attention`), and each (query block, key block)
pair, rows from global position q0 and keys from k0, is one local call of the
block kernel with the functions at the pair's global origin,

    score_mod_pair(s, b, h, i, j) = score_mod(s, b, h, i + q0, j + k0)
    mask_mod_pair(b, h, i, j)     = mask_mod(b, h, i + q0, j + k0)

and the BlockMask cut to the pair from the full one's block table
(`attngrad.ring.shifted.pair_block_mask`); a pair it leaves empty is skipped
(`attngrad.ring.flex_pairs`).  The gathered call is checked first, on
stand-ins over the full sequence, before any collective.

A tensor the score_mod captures (ALiBi slopes, a relative table) is read by
every rank's local calls for that rank's heads (all-to-all) or rows (ring), so
its gradient on a rank is that rank's share: sum it over the group
(``dist.all_reduce(t.grad)``), as for any parameter replicated across the
ranks.  Every derivative of flex_attention carries over under the all-to-all
(the trades are linear `autograd.Function`\ s): backward, double backward,
forward mode, torch.func's transforms; under the ring, backward, double
backward, forward mode (``forward_ad``, ``torch.func.jvp``) and
``torch.func.grad``, as `attngrad.ring_attention`'s.
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from typing import Any

import torch

from attngrad.api import flex_attention
from attngrad.call.flex import FlexCall
from attngrad.core.block_table import is_no_mask
from attngrad.core.contract import (
    ArgumentError,
    ArgumentTypeError,
    Shapes,
    check_flag,
    validate_attention,
)
from attngrad.core.pointwise import check_arity
from attngrad.core.scores import ScoreMods
from attngrad.ring.all_to_all import check_heads, over_heads
from attngrad.ring.attention import BLOCK_STRATEGIES, flex_over_ring
from attngrad.ring.checks import (
    Settings,
    block_mask_of,
    check_same_shards,
    process_group,
    validate_ring,
    validate_scheme,
)
from attngrad.ring.comm import DEFAULT_TIMEOUT, RingComm
from attngrad.ring.flex_pairs import FlexPairs
from attngrad.ring.shifted import at_heads
from attngrad.strategies import REGISTRY, STRATEGIES, tiled_default, unavailable_reason

__all__ = ["at_heads", "flex_ring_attention", "local_block_mask"]

# -- the BlockMask at the rank's heads ------------------------------------------------------

# BlockMask -> {(first head, heads): (its mask_mod, its block lists, the local BlockMask)}
_LOCAL: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], tuple[Any, tuple[Any, ...], Any]]] = (
    weakref.WeakKeyDictionary()
)
_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _sliced(block_mask: Any, heads: slice) -> Any:
    """block_mask's block lists cut to ``heads`` (the orders torch derives from them left
    out: nothing here reads them)."""
    local = copy.copy(block_mask)
    for name, t in vars(block_mask).items():
        if isinstance(t, torch.Tensor) and t.dim() >= 3:
            setattr(local, name, t[:, heads] if name in _ALL_LISTS else None)
    return local


_ALL_LISTS = frozenset(
    prefix + suffix
    for prefix in ("", "full_")
    for suffix in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices")
)


def local_block_mask(block_mask: Any, start: int, heads: int) -> Any:
    """``block_mask`` (built for the full sequence, [Bm, Hq or 1, ...]) as the local call
    over query heads start .. start + heads - 1 takes it: a per-head one sliced to those
    heads, its mask_mod given global heads (`at_heads`); kept across calls per
    (BlockMask, start, heads) while its mask_mod and block lists stay the same objects."""
    lists = tuple(getattr(block_mask, name) for name in _LISTS)
    known = _LOCAL.setdefault(block_mask, {})
    found = known.get((start, heads))
    if (
        found is not None
        and found[0] is block_mask.mask_mod
        and all(a is b for a, b in zip(found[1], lists, strict=True))
    ):
        return found[2]
    if block_mask.kv_num_blocks.shape[1] > 1:  # one entry per head: the rank's
        try:
            local = block_mask[:, start : start + heads]
        except NotImplementedError:  # torch's slice refuses some of its own orders
            local = _sliced(block_mask, slice(start, start + heads))
    elif start == 0:
        local = block_mask
    else:
        local = copy.copy(block_mask)
    if start != 0:
        local.mask_mod = at_heads(block_mask.mask_mod, start, 4)
    elif local is not block_mask:
        local.mask_mod = block_mask.mask_mod  # torch's slice puts a stand-in there
    known[start, heads] = (block_mask.mask_mod, lists, local)
    return local


# -- the call ----------------------------------------------------------------------------


def _stand_in_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: int,
    heads_shared: bool,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    strategy: str,
) -> FlexCall:
    """A call checked before any collective, on stand-ins (zero-stride: no memory) over the
    full sequence: the all-to-all's local call over H/P heads [B, H/P, N, d] when
    ``heads_shared``, else the gathered call [B, H, N, d]: its score_mod, BlockMask and
    strategy."""
    b, hq, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    split = world if heads_shared else 1

    def like(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return t.new_zeros(()).expand(b, heads // split, n * world, dim)

    return FlexCall.build(
        like(q, hq, d), like(k, hkv, d), like(v, hkv, dv), score_mod, block_mask, scale,
        enable_gqa, True, None, None, strategy,
    )  # fmt: skip


def _ring_strategy(strategy: str, q: torch.Tensor, shapes: Shapes, mods: ScoreMods) -> str:
    """The block kernel: ``strategy``, or for "auto" the ring's default (`tiled_default`),
    flash where that one cannot run the score_mod or BlockMask (warned once per reason)."""
    if strategy != "auto":
        reason = REGISTRY[strategy].refuses(mods)
        if reason is not None:
            raise ArgumentError(f"strategy={strategy!r} cannot run this call: {reason}")
        return strategy
    name = tiled_default(q.device, shapes.head_dim, shapes.value_dim)
    reason = REGISTRY[name].refuses(mods)
    if reason is None:
        return name
    warnings.warn(
        f"attngrad: strategy='auto' runs flex_ring_attention's blocks on 'flash' (tensor ops, "
        f"slower) instead of {name!r}: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )
    return "flash"


def _over_ring(
    comm: RingComm,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shapes: Shapes,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    layout: str,
    strategy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of scheme="ring" (module docstring): the gathered call checked on
    stand-ins, the ranks' settings compared, then the ring (`flex_over_ring`)."""
    p = comm.world
    # flash takes every score_mod and BlockMask: the check of the call itself
    call = _stand_in_call(q, k, v, p, False, score_mod, block_mask, scale, enable_gqa, "flash")
    mods = call.problem.mods
    name = _ring_strategy(strategy, q, shapes, mods)
    REGISTRY[name].tiles(shapes, q.dtype, None, None)  # ArgumentError for sizes it cannot take
    score = mods.score
    captured = () if score is None else score.captured
    wants = ["score_mod"] if any(t.requires_grad for t in captured) else []
    wants += [n for n, t in zip("qkv", (q, k, v), strict=True) if t.requires_grad]
    s = call.problem.scale
    settings = Settings(
        False, layout, s, 0.0, "ring",
        score_mod=score_mod is not None,
        block_mask=() if block_mask is None else block_mask_of(block_mask),
        requires_grad=tuple(wants) if torch.is_grad_enabled() else (),
    )  # fmt: skip
    check_same_shards(comm, q, shapes, settings)
    keys = () if score is None else score.keys
    pairs = FlexPairs.kept(score_mod, block_mask, mods.blocks, keys, name, s, q, k, v)
    return flex_over_ring(comm, layout, name, q, k, v, s, pairs, captured)


def flex_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    *,
    group: Any = None,
    scheme: str = "all_to_all",
    layout: str = "contiguous",
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    strategy: str = "auto",
) -> Any:
    r"""`attngrad.flex_attention` over a sequence sharded across the ranks of ``group``.

    q: [B, Hq, N/P, d], k: [B, Hkv, N/P, d], v: [B, Hkv, N/P, dv] -> [B, Hq, N/P, dv]: this
    rank's shard of ``flex_attention(Q, K, V, score_mod, block_mask, scale, enable_gqa)``
    over the full sequence, cut as ``layout`` says (`attngrad.ring.shard`: "contiguous"
    or "zigzag").  ``score_mod`` and the ``block_mask``'s mask_mod are written for the full
    sequence, as for a single call: global positions, global query heads; the BlockMask
    is built for the full sequence, [B or 1, Hq or 1, N, N] (``create_block_mask(mask_mod,
    B, H, N, N)``), the same on every rank.

    ``scheme``: "all_to_all" (the default): each rank computes Hq/P whole heads over every
    position (module docstring), so Hq and Hkv must divide by P, and the work is balanced
    whatever the mask; every derivative works: backward, double backward, forward mode,
    torch.func's transforms (every rank alike).  "ring": each rank computes its rows of
    every head against one key block at a time, the functions called at each pair's
    global positions ``(i + q0, j + k0)`` and the BlockMask cut to the pair; pairs the
    BlockMask leaves empty are skipped (balance them with `attngrad.ring.balanced_layout`);
    any Hq, Hkv (GQA); backward, double backward, forward mode (``forward_ad``,
    ``torch.func.jvp``) and ``torch.func.grad``.
    Under either, a tensor the score_mod captures gets this rank's share of its gradient:
    sum it over ``group`` (``dist.all_reduce``).

    ``return_lse=True`` returns (out, lse [B, Hq, N/P]).  ``strategy``: under "all_to_all"
    the local call's (any of `attngrad.STRATEGIES`, or "auto"); under "ring" the block
    kernel, one of `attngrad.ring.BLOCK_STRATEGIES` or "auto" (fused on CPU, triton on
    CUDA, flash where that one refuses the score_mod; another raises ValueError).  ``group``, ``timeout``: as in
    `attngrad.ring_attention`; without a process group, or with one rank, this is
    `attngrad.flex_attention`.  Different shapes, settings, score_mod presence or
    BlockMasks on different ranks raise ValueError on every rank.

    >>> q = torch.randn(1, 2, 16, 8)                    # no process group: one rank
    >>> flex_ring_attention(q, q, q, lambda s, b, h, i, j: s - (i - j).abs()).shape
    torch.Size([1, 2, 16, 8])
    """
    scheme = validate_scheme(scheme)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ArgumentError(
                f"flex_ring_attention takes 4-D {name} [B, H, N/P, d] (as flex_attention "
                f"does), got shape {tuple(t.shape)}."
            )
    shapes = validate_attention(q, k, v, None, 0.0, False, scale, enable_gqa)
    check_flag("return_lse", return_lse)
    if scheme == "ring":
        validate_ring(shapes, layout, timeout, strategy, ("auto", *BLOCK_STRATEGIES),
                      "block kernel (flex_ring_attention's scheme='ring'; scheme='all_to_all' "
                      "takes every strategy)")  # fmt: skip
    else:
        validate_ring(shapes, layout, timeout, strategy, ("auto", *STRATEGIES),
                      "local call (flex_ring_attention)")  # fmt: skip
    if strategy != "auto":
        reason = unavailable_reason(strategy, q.device)
        if reason is not None:
            raise RuntimeError(reason)
    if score_mod is not None:
        check_arity(score_mod, "score_mod", 5, "score_mod(score, b, h, q_idx, kv_idx) -> score")
    group = process_group(group)
    if group is None:
        return flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse,
                              strategy=strategy)  # fmt: skip
    comm = RingComm(group, float(timeout))
    p, n = comm.world, shapes.seq_q
    if is_no_mask(block_mask, n * p, n * p):
        block_mask = None  # torch's stand-in for no mask
    if scheme == "ring":
        o_r, lse_r = _over_ring(comm, q, k, v, shapes, score_mod, block_mask, scale, enable_gqa,
                                layout, strategy)  # fmt: skip
        return (o_r, lse_r) if return_lse else o_r
    heads = shapes.heads_q // p
    start = comm.rank * heads
    score_l, mask_l, wants = score_mod, block_mask, []
    if shapes.heads_q % p == 0 and shapes.heads_kv % p == 0:  # else check_heads raises below
        score_l = at_heads(score_mod, start, 5)
        if block_mask is not None:
            if not hasattr(block_mask, "kv_num_blocks"):
                raise ArgumentTypeError(
                    f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (from "
                    f"create_block_mask), got {type(block_mask).__name__}."
                )
            mask_l = local_block_mask(block_mask, start, heads)
        call = _stand_in_call(q, k, v, p, True, score_l, mask_l, scale, enable_gqa, strategy)
        score = call.problem.mods.score
        if score is not None and any(t.requires_grad for t in score.captured_originals):
            wants.append("score_mod")
    wants += [name for name, t in zip("qkv", (q, k, v), strict=True) if t.requires_grad]
    settings = Settings(
        False, layout, 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale), 0.0,
        scheme,
        score_mod=score_mod is not None,
        block_mask=() if block_mask is None else block_mask_of(block_mask),
        requires_grad=tuple(wants) if torch.is_grad_enabled() else (),
    )  # fmt: skip
    check_same_shards(comm, q, shapes, settings)
    check_heads(shapes, p)

    def local(
        ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = flex_attention(ql, kl, vl, score_l, mask_l, scale, enable_gqa, True,
                                strategy=strategy)  # fmt: skip
        return o, lse

    out, lse = over_heads(comm, layout, shapes, q, k, v, local, return_lse)
    return (out, lse) if lse is not None else out
