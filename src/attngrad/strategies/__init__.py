"""Execution strategies: the same formulas along different paths.

Each strategy module implements the interface of `attngrad.strategies.base`
(tile choice, forward returning O and what it saves, a backward that adds
into given accumulators, a declaration of what it saves, a reason when it
cannot run here) over the canonical layout q: [B, Hq, Nq, d],
k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv] and a `attngrad.core.masks.Mask`.
`MODULES` maps each name to its module; only "triton" ever has a reason not
to run.
"""

from __future__ import annotations

from types import ModuleType

import torch

from attngrad.core.contract import Shapes
from attngrad.strategies import explicit, flash, recompute
from attngrad.strategies.triton import strategy as triton

__all__ = [
    "MODULES",
    "STRATEGIES",
    "TILED",
    "available",
    "resolve",
    "unavailable_reason",
]

MODULES: dict[str, ModuleType] = {
    "explicit": explicit,
    "recompute": recompute,
    "flash": flash,
    "triton": triton,
}

STRATEGIES: tuple[str, ...] = tuple(MODULES)

TILED = frozenset({"flash", "triton"})

# "auto" on CPU, read off `attngrad bench` (B=1, H=8, d=64, float32, N = 128
# ... 4096): with is_causal, flash's forward+backward beats explicit's from
# N = 512 (Nq * Nk = 2**18; explicit wins at 256); without a band explicit is
# 3% faster at N = 512 and flash 27% faster at N = 1024 (2**20).  Past these
# sizes explicit's saved P (B*H*Nq*Nk elements) is also the largest tensor of
# the call.
AUTO_FLASH_SCORES = 2**20
AUTO_FLASH_SCORES_BANDED = 2**18


def unavailable_reason(strategy: str, device: torch.device) -> str | None:
    """Why ``strategy`` cannot run on ``device`` tensors here, or None when it can."""
    reason: str | None = MODULES[strategy].unavailable_reason(device)
    return reason


def available(device: torch.device, interpreted: bool = False) -> tuple[str, ...]:
    """The strategies that run on ``device`` tensors here, in `STRATEGIES` order.

    Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) runs the kernels at
    numpy speed: it counts only with ``interpreted=True`` (the conformance
    check's small cases), not for timing or memory runs.
    """
    interpreting = device.type == "cpu"
    return tuple(
        s
        for s in STRATEGIES
        if unavailable_reason(s, device) is None
        and (interpreted or not (interpreting and s == "triton"))
    )


def resolve(
    strategy: str,
    shapes: Shapes,
    tiling_given: bool,
    banded: bool = False,
    device: torch.device | None = None,
) -> str:
    """The strategy "auto" stands for; the others resolve to themselves.

    "auto": triton on CUDA when Triton is installed and the head dims fit its
    kernels; otherwise flash when block sizes are given or Nq * Nk reaches
    AUTO_FLASH_SCORES (AUTO_FLASH_SCORES_BANDED with is_causal or a window),
    else explicit.
    """
    if strategy != "auto":
        return strategy
    fits = max(shapes.head_dim, shapes.value_dim) <= triton.MAX_HEAD_DIM
    gpu = device if device is not None and device.type == "cuda" else None
    if gpu is not None and fits and unavailable_reason("triton", gpu) is None:
        return "triton"
    threshold = AUTO_FLASH_SCORES_BANDED if banded else AUTO_FLASH_SCORES
    if tiling_given or shapes.seq_q * shapes.seq_k >= threshold:
        return "flash"
    return "explicit"
