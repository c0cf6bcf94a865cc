"""Side-by-side timing: every contender runs once per round, rounds repeat.

Interleaving spreads the machine's noise (other processes, frequency changes)
over all contenders alike, so their ratio is stable even when absolute times
are not.  Times are wall-clock seconds; on CUDA, callers synchronize inside
the timed function.  `timed_pass` makes the call that one of the `PASSES` times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["PASSES", "Spread", "interleaved", "medians", "spreads", "timed_pass"]

Pass = Literal["forward", "backward", "forward+backward"]
PASSES: tuple[Pass, ...] = ("forward", "backward", "forward+backward")
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def timed_pass(
    pass_: str,
    fn: Attention,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    do: torch.Tensor,
    kept: list[object],
) -> Callable[[], object]:
    """A no-argument call that runs ``pass_`` (one of `PASSES`) of ``fn`` once.

    inputs q, k, v: [B, H, N, d] (requires_grad), do: [B, H, N, d].  ``forward`` builds
    the autograd graph, as training does, and hands O to ``kept``, for the caller to free
    outside the timed region; ``backward`` reuses one graph built here, untimed;
    ``forward+backward`` is O, then dq, dk, dv in one call.
    """
    if pass_ == "forward":
        return lambda: kept.append(fn(*inputs))
    if pass_ == "backward":
        o = fn(*inputs)  # the graph of o is built here, untimed, and reused by every call
        return lambda: torch.autograd.grad(o, inputs, do, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*inputs), inputs, do)


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    repeats: int = 7,
    warmup: int = 1,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, round-robin, after ``warmup`` rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        if on_round is not None:
            on_round(r)
    return times


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    """The median of each contender's times."""
    return {name: statistics.median(ts) for name, ts in times.items()}


@dataclass(frozen=True)
class Spread:
    """Seconds over one contender's repeats: the median and the fastest and slowest."""

    median: float
    low: float
    high: float


def spreads(times: Mapping[str, list[float]]) -> dict[str, Spread]:
    """Each contender's median, min and max."""
    return {name: Spread(statistics.median(ts), min(ts), max(ts)) for name, ts in times.items()}
