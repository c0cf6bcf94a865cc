"""Execution strategies: the same formulas along different paths.

Each strategy module exposes ``attention(q, k, v, mask, scale)`` over the
canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]
and a `attngrad.masks.Mask`, returning O: [B, Hq, Nq, dv].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attngrad.masks import Mask
from attngrad.strategies import explicit

__all__ = ["IMPLEMENTATIONS", "STRATEGIES", "resolve"]

Implementation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Mask, float], torch.Tensor]

IMPLEMENTATIONS: dict[str, Implementation] = {
    "explicit": explicit.attention,
}

STRATEGIES: tuple[str, ...] = tuple(IMPLEMENTATIONS)


def resolve(strategy: str) -> str:
    """The strategy "auto" stands for; others resolve to themselves.

    "auto" is "explicit" while explicit is the only strategy.
    """
    return "explicit" if strategy == "auto" else strategy
