r"""A FlexAttention call's score_mod and BlockMask on each (query block, key block) pair of the ring.

The ring (`attngrad.ring.attention`) computes a rank's rows against one key
block at a time; a block whose rows start at global position q0 and whose keys
start at k0 is one local call over [r, c].  For `flex_ring_attention` with
scheme="ring" that local call takes

* the score_mod at global positions, ``score_mod(s, b, h, i + q0, j + k0)``
  (`attngrad.ring.shifted.shifted`; heads unchanged: the ring keeps every head);
* the BlockMask cut to the pair (`attngrad.ring.shifted.pair_block_mask`), its
  mask_mod shifted the same way; a pair it leaves all empty is skipped;

and is built by `attngrad.call.flex.FlexCall`, as `attngrad.flex_attention`
builds its call: the score function's captured tensors, the BlockMask's table
and the strategy's tiles (whole multiples of the BlockMask's blocks) are the
single call's.  Each pair's is built at its first use and kept across calls
(`FlexPairs.kept`, per BlockMask): forward, backward, forward mode, the
second-order recompute and the next step's call all take it, until the
BlockMask's blocks, its mask_mod or what the mask_mod reads change, or the call
takes another score_mod, strategy, scale or shape.

The captured tensors are inputs of `attngrad.ring.attention.RingAttention`,
in the order of the full call's score function (`FlexPairs.keys`); a pair's
function, found on its own, may list them in another order, so each pair keeps
where its tensors sit in that order (`Pair.order`): its gradients and tangents
are the ring's, read and accumulated in place.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from attngrad.call.flex import FlexCall
from attngrad.core.block_table import BlockTable
from attngrad.core.score_function import ScoreFunction
from attngrad.ring.shifted import pair_block_mask, shifted

__all__ = ["FlexPairs", "Pair"]

# the full call's BlockMask -> (what its pairs were built from, its status, the pairs)
_KEPT: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], torch.Tensor, dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Pair:
    """One pair's local call: its score function (over the captured tensors it was built
    with), BlockMask table and tiles; ``order``: where each of its captured tensors sits
    among the ring's (`FlexPairs.keys`); ``empty``: the BlockMask leaves every score out."""

    score: ScoreFunction | None
    blocks: BlockTable | None
    tiles: Any
    order: tuple[int, ...]
    empty: bool

    def pick(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """The ring's captured tensors (or their gradients, tangents) in this pair's order."""
        return tuple(tensors[i] for i in self.order)

    def score_over(self, captured: tuple[torch.Tensor, ...]) -> ScoreFunction | None:
        """The pair's score function reading the ring's ``captured`` (saved, or the inputs)."""
        return None if self.score is None else self.score.with_captured(self.pick(captured))


@dataclass(frozen=True, eq=False)
class FlexPairs:
    """The full call's ``score_mod`` and ``block_mask`` (None for none), as every pair of the
    ring takes them: ``status``, the BlockMask's block statuses (uint8 [Bm, Hm, QB, KB],
    `BlockTable.status`); ``keys``, the identities of the full call's captured tensors, in
    RingAttention's order; ``strategy``: the block kernel's name; ``scale``."""

    score_mod: Any
    block_mask: Any
    status: torch.Tensor | None
    keys: tuple[int, ...]
    strategy: str
    scale: float
    _found: dict[tuple[int, ...], Pair] = field(default_factory=dict, repr=False)

    @classmethod
    def kept(
        cls,
        score_mod: Any,
        block_mask: Any,
        blocks: BlockTable | None,
        keys: tuple[int, ...],
        strategy: str,
        scale: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> FlexPairs:
        """The pairs of a call with q: [B, Hq, n, d], k: [B, Hkv, n, d], v: [B, Hkv, n, dv]
        (this rank's shards), ``blocks`` the full BlockMask's table (None without one): the
        pairs an earlier call with the same BlockMask built, while what they were built
        from is the same (module docstring), else none yet."""
        if block_mask is None or blocks is None:
            return cls(score_mod, block_mask, None, keys, strategy, scale)
        read = tuple((id(t), t._version) for t in blocks.mask.captured)
        basis = (score_mod, block_mask.mask_mod, read, keys, strategy, scale, q.dtype, q.device,
                 q.shape[:2], k.shape[:2], q.shape[3], v.shape[3])  # fmt: skip
        known = _KEPT.get(block_mask)
        if known is None or known[0] != basis or not torch.equal(known[1], blocks.status):
            known = _KEPT[block_mask] = (basis, blocks.status, {})
        return cls(score_mod, block_mask, blocks.status, keys, strategy, scale, known[2])

    def pair(
        self, origin: tuple[int, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Pair:
        """The pair whose rows start at global position ``origin[0]`` and keys at ``origin[1]``,
        q: [B, Hq, r, d], k: [B, Hkv, c, d], v: [B, Hkv, c, dv] (built at its first use)."""
        key = (*origin, q.shape[2], k.shape[2])
        found = self._found.get(key)
        if found is not None:
            return found
        score_mod = shifted(self.score_mod, 5, q=origin[0], kv=origin[1])
        mask, empty = None, False
        if self.block_mask is not None:
            assert self.status is not None
            mask, empty = pair_block_mask(
                self.block_mask, self.status, origin, (q.shape[2], k.shape[2])
            )
        call = FlexCall.build(
            q, k, v, score_mod, mask, self.scale, True, False, None, None, self.strategy
        )
        mods = call.problem.mods
        order: tuple[int, ...] = ()
        if mods.score is not None:
            missing = [i for i in mods.score.keys if i not in self.keys]
            if missing:
                raise RuntimeError(
                    "score_mod read a tensor at a shifted position that it did not read at "
                    "(0, 0): a score_mod must read the same tensors at every position."
                )
            order = tuple(self.keys.index(i) for i in mods.score.keys)
        found = self._found[key] = Pair(mods.score, mods.blocks, call.problem.tiles, order, empty)
        return found
