"""Execution strategies: the same formulas along different paths.

Each strategy module exposes ``attention(q, k, v, mask, scale)`` over the
canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]
and a `attngrad.masks.Mask`, returning O: [B, Hq, Nq, dv]; the tiled ones
also take ``block_q`` and ``block_k``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attngrad.contract import Shapes
from attngrad.strategies import explicit, flash, recompute

__all__ = ["IMPLEMENTATIONS", "STRATEGIES", "TILED", "resolve"]

IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "explicit": explicit.attention,
    "recompute": recompute.attention,
    "flash": flash.attention,
}

STRATEGIES: tuple[str, ...] = tuple(IMPLEMENTATIONS)

TILED = frozenset({"flash"})

# Above this many scores per (batch, head) "auto" prefers flash on CPU: from
# `attngrad bench`, flash overtakes explicit near N = 1024 (and P alone would
# take B*H*N*N*4 bytes).
AUTO_FLASH_SCORES = 1024 * 1024


def resolve(strategy: str, shapes: Shapes, tiling_given: bool) -> str:
    """The strategy "auto" stands for; the others resolve to themselves.

    "auto": flash when block sizes are given or Nq * Nk >= AUTO_FLASH_SCORES,
    else explicit (short sequences: fewest passes over the small P).
    """
    if strategy != "auto":
        return strategy
    if tiling_given or shapes.seq_q * shapes.seq_k >= AUTO_FLASH_SCORES:
        return "flash"
    return "explicit"
