"""Execution strategies: the same formulas along different paths; this is their registry.

Each strategy module implements the interface of `attngrad.strategies.base`
(tile choice, forward returning O and what it saves, a backward that adds
into given accumulators, a declaration of what it saves, a reason when it
cannot run here) over the canonical layout q: [B, Hq, Nq, d],
k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv] and a `attngrad.core.scores.ScoreMods`,
and declares its traits (``TILED``: it takes block sizes).  No strategy
imports another; what they share is `attngrad.strategies.common`.

This module alone knows which strategies exist (`MODULES`, `STRATEGIES`),
which are tiled (`TILED`, collected from the modules), which run here
(`available`, `unavailable_reason`; only "triton" ever has a reason not to
run) and what "auto" stands for (`resolve`, and `tiled_default` among the
tiled ones).
"""

from __future__ import annotations

from types import ModuleType

import torch

from attngrad.core.contract import Shapes
from attngrad.strategies import explicit, flash, recompute
from attngrad.strategies.fused import strategy as fused_strategy
from attngrad.strategies.triton import strategy as triton_strategy

__all__ = [
    "MODULES",
    "STRATEGIES",
    "TILED",
    "available",
    "resolve",
    "tiled_default",
    "unavailable_reason",
]

MODULES: dict[str, ModuleType] = {
    "explicit": explicit,
    "recompute": recompute,
    "flash": flash,
    "fused": fused_strategy,
    "triton": triton_strategy,
}

STRATEGIES: tuple[str, ...] = tuple(MODULES)

# The strategies that take block sizes (block_q, block_k), in `STRATEGIES` order.
TILED: tuple[str, ...] = tuple(name for name, module in MODULES.items() if module.TILED)

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
    if _triton_runs(device, shapes.head_dim, shapes.value_dim):
        return "triton"
    threshold = AUTO_FLASH_SCORES_BANDED if banded else AUTO_FLASH_SCORES
    if tiling_given or shapes.seq_q * shapes.seq_k >= threshold:
        return "flash"
    return "explicit"


def tiled_default(device: torch.device, head_dim: int, value_dim: int) -> str:
    """The tiled strategy for ``device`` tensors with head dims d, dv (ring attention's blocks).

    triton on CUDA when Triton is installed and the head dims fit its kernels
    (as "auto" picks), else flash.
    """
    return "triton" if _triton_runs(device, head_dim, value_dim) else "flash"


def _triton_runs(device: torch.device | None, head_dim: int, value_dim: int) -> bool:
    """Whether "auto" takes triton: CUDA tensors, Triton installed, head dims that fit."""
    if device is None or device.type != "cuda":
        return False
    fits = max(head_dim, value_dim) <= triton_strategy.MAX_HEAD_DIM
    return fits and unavailable_reason("triton", device) is None
