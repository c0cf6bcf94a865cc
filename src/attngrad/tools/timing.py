"""Side-by-side timing: every contender runs once per round, rounds repeat.

Interleaving spreads the machine's noise (other processes, frequency changes)
over all contenders alike, so their ratio is stable even when absolute times
are not.  Times are wall-clock seconds; on CUDA, callers synchronize inside
the timed function.  `timed_pass` makes the call that one of the `PASSES` times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "PASSES",
    "SPREAD_LIMIT",
    "Spread",
    "interleaved",
    "medians",
    "spread_warning",
    "spreads",
    "timed_pass",
]

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


# Rounds of one contender that differ by more than this share of their median: the machine
# was busy (on a quiet machine they agree within a few percent)
SPREAD_LIMIT = 0.2


def spread_warning(
    timed: Sequence[tuple[str, float, float, float]], limit: float = SPREAD_LIMIT
) -> str | None:
    """A warning where some measurements' rounds spread more than ``limit`` of their median,
    or None: ``timed`` holds (what was timed, median, fastest, slowest round), in seconds.

    >>> warning = spread_warning([("forward explicit N=1024", 1.0, 0.92, 1.08),
    ...                           ("backward flash N=1024", 1.0, 0.2, 1.8)])
    >>> print(warning[:warning.index(":", 9)])
    warning: the rounds of 1 of 2 measurements spread by more than 20% of their median (worst
    >>> "backward flash N=1024, 200.00-1800.00 ms, 9.0x" in warning
    True
    """
    wide = [t for t in timed if t[3] - t[2] > limit * t[1]]
    if not wide:
        return None
    what, _, low, high = max(wide, key=lambda t: (t[3] - t[2]) / t[1])
    return (
        f"warning: the rounds of {len(wide)} of {len(timed)} measurements spread by more than "
        f"{limit:.0%} of their median (worst: {what}, {low * 1e3:.2f}-{high * 1e3:.2f} ms, "
        f"{high / low:.1f}x from fastest to slowest): the machine was busy, so these figures "
        "are unreliable; run again on a quiet machine (more --repeats steadies the medians, "
        "not the rounds)"
    )
