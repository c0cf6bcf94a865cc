r"""FlexAttention's functions and BlockMasks moved to where a local call sits in the gathered call.

A rank's local call numbers its heads, query rows and keys from 0, while the
``score_mod`` and ``mask_mod`` it was given are written for the full call.
`shifted` wraps a function so that the local call's (h, q_idx, kv_idx) reach it
as the gathered call's,

    score_mod'(s, b, h, i, j) = score_mod(s, b, h + dh, i + dq, j + dk)
    mask_mod'(b, h, i, j)     = mask_mod(b, h + dh, i + dq, j + dk)

(Python ints baked in: the wrapper stays elementwise, fused's score and mask
programs trace it as INDEX + CONST).  The all-to-all moves heads
(`at_heads`); the ring moves positions to each (query block, key block)
pair's global origin.

The compiled programs (`attngrad.core.score_program`) and a BlockMask's band
(`attngrad.core.block_table`) are found once per function and kept across
calls, so the wrappers are too: one per (function, offsets), kept in the
function's own ``__dict__`` (a plain Python function: it lives exactly as long
as the function, no global table holds it), or, for another callable (a bound
method, a callable object), in a table that holds it only while a call or an
autograd graph uses it.

`pair_block_mask` cuts a BlockMask built for the full sequence to one pair of
the ring: rows q0 .. q0 + r - 1 against keys k0 .. k0 + c - 1, in blocks of the
same size.  Where the origins are multiples of the block size each local
block is one global block; elsewhere a local block straddles up to 2 x 2
global ones and is empty where all are empty, full where all are full, else
partial (its mask_mod, shifted, decides each score): O(blocks) either way,
and exact.  A pair whose blocks are all empty has no BlockMask (None: the
ring skips it).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from attngrad.core.block_table import EMPTY, FULL, PARTIAL

__all__ = ["at_heads", "pair_block_mask", "shifted"]

_SHIFTED = "_attngrad_shifted"  # a plain function's wrappers, {(arity, dh, dq, dk): wrapper}
# other callables' wrappers, held only while in use (module docstring)
_HELD: weakref.WeakKeyDictionary[
    Any, weakref.WeakValueDictionary[tuple[int, int, int, int], Any]
] = weakref.WeakKeyDictionary()


def _wrap(fn: Callable[..., torch.Tensor], arity: int, dh: int, dq: int, dk: int) -> Any:
    """fn with its (head, q_idx, kv_idx) moved by (dh, dq, dk) (a score_mod: arity 5; a
    mask_mod: 4); an offset of 0 leaves its index as it is."""
    if arity == 5:

        def score_mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
            return fn(
                s, b, h + dh if dh else h, q_idx + dq if dq else q_idx,
                kv_idx + dk if dk else kv_idx,
            )  # fmt: skip

        return score_mod

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return fn(b, h + dh if dh else h, q_idx + dq if dq else q_idx,
                  kv_idx + dk if dk else kv_idx)  # fmt: skip

    return mask_mod


def shifted(fn: Any, arity: int, head: int = 0, q: int = 0, kv: int = 0) -> Any:
    """``fn`` (a score_mod of ``arity`` 5 or a mask_mod of 4) as a local call whose head h,
    query i and key j are the gathered call's h + ``head``, i + ``q`` and j + ``kv`` sees it:
    fn itself where every offset is 0, else one wrapper per (fn, offsets), the same object
    at every call (module docstring).

    >>> f = lambda s, b, h, i, j: s + 10 * h + i - j
    >>> g = shifted(f, 5, head=1, q=4, kv=2)
    >>> g is shifted(f, 5, head=1, q=4, kv=2), int(g(torch.tensor(0), 0, torch.tensor(0), 0, 0))
    (True, 12)
    """
    if fn is None or head == q == kv == 0:
        return fn
    key = (arity, head, q, kv)
    if isinstance(fn, types.FunctionType):
        table: Any = fn.__dict__.setdefault(_SHIFTED, {})
    else:
        try:
            table = _HELD.setdefault(fn, weakref.WeakValueDictionary())
        except TypeError:  # takes no weak reference: a wrapper per call
            return _wrap(fn, *key)
    found = table.get(key)
    if found is None:
        found = table[key] = _wrap(fn, *key)
    return found


def at_heads(fn: Any, offset: int, arity: int) -> Any:
    """``fn`` (a score_mod of ``arity`` 5 or a mask_mod of 4) as a call whose head h is the
    gathered call's head h + ``offset`` sees it (`shifted`).

    >>> f = lambda s, b, h, i, j: s + h
    >>> g = at_heads(f, 2, 5)
    >>> g is at_heads(f, 2, 5), int(g(torch.tensor(0), 0, torch.tensor(1), 0, 0))
    (True, 3)
    """
    return shifted(fn, arity, head=offset)


# -- a BlockMask cut to one (query block, key block) pair ---------------------------------

# BlockMask -> {(q0, k0, r, c): (its mask_mod, its block lists, (the pair's BlockMask, empty))}
_PAIRS: weakref.WeakKeyDictionary[
    Any, dict[tuple[int, ...], tuple[Any, tuple[Any, ...], tuple[Any, bool]]]
] = weakref.WeakKeyDictionary()
_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _covered(start: int, extent: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last global block each local block of [start, start + extent) touches:
    int64 [ceil(extent / block)] each (equal where start is a multiple of block)."""
    first = start + torch.arange(0, extent, block)
    last = torch.clamp(first + block, max=start + extent) - 1
    return first // block, last // block


def _pair_status(status: torch.Tensor, block: tuple[int, int], origin: tuple[int, int],
                 extent: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The pair's block statuses [Bm, Hm, ceil(r / bq), ceil(c / bk)] from the full
    sequence's ``status`` [Bm, Hm, QB, KB] (`attngrad.core.block_table.BlockTable`)."""
    (q_lo, q_hi), (k_lo, k_hi) = (_covered(o, e, b) for o, e, b in zip(origin, extent, block,
                                                                         strict=True))  # fmt: skip
    rows = (status[:, :, q_lo], status[:, :, q_hi])  # [Bm, Hm, qb, KB]
    top = torch.maximum(*rows)  # EMPTY only where every block is
    low = torch.minimum(*rows)  # FULL only where every block is
    top = torch.maximum(top[..., k_lo], top[..., k_hi])
    low = torch.minimum(low[..., k_lo], low[..., k_hi])
    partial = torch.full_like(top, PARTIAL)
    return torch.where(top == EMPTY, EMPTY, torch.where(low == FULL, FULL, partial))


def _listed(status: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [Bm, Hm, qb], indices [Bm, Hm, qb, kb]) int32: the blocks of ``kind`` first."""
    hit = status == kind
    order = torch.sort((~hit).to(torch.uint8), dim=-1, stable=True).indices
    return hit.sum(-1).to(torch.int32), order.to(torch.int32)


def pair_block_mask(
    block_mask: Any, status: torch.Tensor, origin: tuple[int, int], extent: tuple[int, int]
) -> tuple[Any, bool]:
    """``block_mask`` (built for the full sequence; ``status`` its blocks' statuses, uint8
    [Bm, Hm, QB, KB] on the host) cut to the rows ``origin[0]`` .. + ``extent[0]`` - 1 against
    the keys ``origin[1]`` .. + ``extent[1]`` - 1: a BlockMask over [r, c] in blocks of the
    same size whose mask_mod sees global positions (`shifted`), and whether every block
    of it is empty.  Kept across calls per (BlockMask, origin, extent) while its
    mask_mod and block lists stay the same objects."""
    from torch.nn.attention.flex_attention import BlockMask

    lists = tuple(getattr(block_mask, name) for name in _LISTS)
    known = _PAIRS.setdefault(block_mask, {})
    key = (*origin, *extent)
    found = known.get(key)
    if (
        found is not None
        and found[0] is block_mask.mask_mod
        and all(a is b for a, b in zip(found[1], lists, strict=True))
    ):
        return found[2]
    block = (int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1]))
    local_status = _pair_status(status, block, origin, extent)
    device = block_mask.kv_num_blocks.device
    (num, idx), (full_num, full_idx) = (
        tuple(t.to(device) for t in _listed(local_status, kind)) for kind in (PARTIAL, FULL)
    )
    local = BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=block,
        mask_mod=shifted(block_mask.mask_mod, 4, q=origin[0], kv=origin[1]),
        seq_lengths=extent,
    )  # fmt: skip
    result = (local, not bool((local_status != EMPTY).any()))
    known[key] = (block_mask.mask_mod, lists, result)
    return result
