"""Execution strategies: the same formulas along different paths; this is their registry.

Each strategy module holds one `attngrad.core.interface.Strategy` (tile
choice, forward returning O and what it saves, a backward that adds into
given accumulators, a declaration of what it saves, a reason when it cannot
run here), taking one `attngrad.core.interface.Problem` over the canonical
layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv], and
declares its traits (``tiled``: it takes block sizes).  No strategy
imports another; what they share is `attngrad.strategies.common`.

This module alone knows which strategies exist (`REGISTRY`, `STRATEGIES`),
which are tiled (`TILED`, collected from the strategies), which run here
(`available`, `unavailable_reason`: "triton" needs Triton and CUDA or its
interpreter, "fused" a CPU and its compiled kernels) and what "auto" stands
for (`resolve`, and `tiled_default` among the tiled ones).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from attngrad.core.contract import ArgumentError, Shapes
from attngrad.core.interface import Strategy
from attngrad.core.scores import ScoreMods
from attngrad.strategies import explicit, flash, recompute
from attngrad.strategies.fused import build as fused_build
from attngrad.strategies.fused import strategy as fused_strategy
from attngrad.strategies.triton import strategy as triton_strategy

__all__ = [
    "REGISTRY",
    "STRATEGIES",
    "TILED",
    "available",
    "resolve",
    "resolve_for",
    "tiled_default",
    "unavailable_reason",
]

REGISTRY: dict[str, Strategy[Any]] = {
    s.name: s
    for s in (
        explicit.strategy,
        recompute.strategy,
        flash.strategy,
        fused_strategy.strategy,
        triton_strategy.strategy,
    )
}

STRATEGIES: tuple[str, ...] = tuple(REGISTRY)

# The strategies that take block sizes (block_q, block_k), in `STRATEGIES` order.
TILED: tuple[str, ...] = tuple(name for name, s in REGISTRY.items() if s.tiled)

# "auto" on CPU, read off `attngrad bench` (B=1, H=8, d=64, float32, N = 128
# ... 4096): with is_causal, flash's forward+backward beats explicit's from
# N = 512 (Nq * Nk = 2**18; explicit wins at 256); without a band explicit is
# 3% faster at N = 512 and flash 27% faster at N = 1024 (2**20).  Past these
# sizes explicit's saved P (B*H*Nq*Nk elements) is also the largest tensor of
# the call.  These apply where "fused" cannot run.
AUTO_FLASH_SCORES = 2**20
AUTO_FLASH_SCORES_BANDED = 2**18
# Where "fused" runs, "auto" takes it at every size: `benchmarks/benchmark_fused.py --auto`
# (B=1, H=8, d=64, float32, fwd+bwd, explicit, flash and fused interleaved in one run;
# docs/strategies.md) found it the fastest at every N measured, 4 to 2048, with and without
# is_causal, on a 2-core AMD EPYC with AVX-512, at ATen's AVX-512 and at AVX2
# (ATEN_CPU_CAPABILITY=avx2): N = 16, fused 0.40 ms, explicit 0.56 ms; N = 4, 0.37 against
# 0.58.  Its call costs less than explicit's ops even where there is no tile to fuse.

_fell_back: list[str] = []  # the reason "auto" once fell back from fused to flash (warned once)


def unavailable_reason(strategy: str, device: torch.device) -> str | None:
    """Why ``strategy`` cannot run on ``device`` tensors here, or None when it can."""
    return REGISTRY[strategy].unavailable_reason(device)


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
    kernels.  On CPU, fused at every size, if its kernels can be built here
    (else one warning).  Otherwise flash when block sizes are given or Nq * Nk
    reaches AUTO_FLASH_SCORES (AUTO_FLASH_SCORES_BANDED under a band), else
    explicit.
    """
    if strategy != "auto":
        return strategy
    if _triton_runs(device, shapes.head_dim, shapes.value_dim):
        return "triton"
    if _fused_runs(device):
        return "fused"
    scores = shapes.seq_q * shapes.seq_k
    threshold = AUTO_FLASH_SCORES_BANDED if banded else AUTO_FLASH_SCORES
    if tiling_given or scores >= threshold:
        return "flash"
    return "explicit"


def resolve_for(
    strategy: str, shapes: Shapes, mods: ScoreMods, tiling_given: bool, device: torch.device
) -> str:
    """`resolve` for a call with these mods: a named strategy that cannot run them raises
    ArgumentError with its reason; "auto" passes over such a strategy to the fastest
    tensor-op strategy (flash or explicit, by `resolve`'s sizes)."""
    name = resolve(strategy, shapes, tiling_given, mods.banded, device)
    reason = REGISTRY[name].refuses(mods)
    if reason is None:
        return name
    if strategy != "auto":
        raise ArgumentError(f"strategy={strategy!r} cannot run this call: {reason}")
    scores = shapes.seq_q * shapes.seq_k
    threshold = AUTO_FLASH_SCORES_BANDED if mods.banded else AUTO_FLASH_SCORES
    fallback = "flash" if tiling_given or scores >= threshold else "explicit"
    if mods.score is not None and name == "fused":  # once per reason (Python's filter)
        warnings.warn(
            f"attngrad: strategy='auto' runs this score_mod on {fallback!r} (tensor ops, "
            f"slower) instead of {name!r}: {reason}",
            RuntimeWarning,
            stacklevel=4,
        )
    return fallback


def tiled_default(device: torch.device, head_dim: int, value_dim: int) -> str:
    """The tiled strategy for ``device`` tensors with head dims d, dv (ring attention's blocks).

    triton on CUDA when Triton is installed and the head dims fit its kernels
    (as "auto" picks), fused on CPU where its kernels build, else flash.
    """
    if _triton_runs(device, head_dim, value_dim):
        return "triton"
    return "fused" if _fused_runs(device) else "flash"


def _fused_runs(device: torch.device | None) -> bool:
    """Whether "auto" may take fused: CPU tensors and kernels that build here.

    Where they cannot be built, the first call that would have taken fused warns
    once, with the reason (what to install), and every such call takes the
    tensor-op strategies' rule (flash from AUTO_FLASH_SCORES, else explicit).
    """
    if device is not None and device.type != "cpu":
        return False
    with fused_build.because("strategy 'auto' takes fused's C++ kernels for CPU tensors"):
        reason = unavailable_reason("fused", torch.device("cpu"))
    if reason is not None and not _fell_back:
        _fell_back.append(reason)
        warnings.warn(
            f"attngrad: strategy='auto' runs 'flash' on CPU instead of 'fused': {reason}",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason is None


def _triton_runs(device: torch.device | None, head_dim: int, value_dim: int) -> bool:
    """Whether "auto" takes triton: CUDA tensors, Triton installed, head dims that fit."""
    if device is None or device.type != "cuda":
        return False
    fits = max(head_dim, value_dim) <= triton_strategy.MAX_HEAD_DIM
    return fits and unavailable_reason("triton", device) is None
