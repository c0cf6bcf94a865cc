"""What the ``attngrad`` commands accept: argparse types and the strategy refusals.

An argparse type raises `argparse.ArgumentTypeError`; argparse then exits 2 with
``argument --NAME: <message>``, so each message shows the value and a fix.  A strategy
that exists but cannot run here is refused after parsing, also with exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import torch

from attngrad.strategies import STRATEGIES, available, unavailable_reason

__all__ = [
    "measure_device",
    "positive_float",
    "positive_int",
    "refuse_unavailable",
    "skipped",
]

# Where the ledger can count bytes: the profiler's allocation events on CPU, the
# allocator's peak counter on CUDA.
MEASURABLE_DEVICES = ("cpu", "cuda")


def positive_int(text: str) -> int:
    """A size: an int >= 1, e.g. ``--seq 1024``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}; try 1024"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}; try 1024")
    return value


def positive_float(text: str) -> float:
    """A duration in seconds: a finite float > 0, e.g. ``--gemm-time 0.2``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds, got {text!r}; try 0.2"
        ) from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds, got {text}; try 0.2"
        )
    return value


def measure_device(text: str) -> torch.device:
    """A device the ledger can measure on here: ``cpu``, or ``cuda[:i]`` with a CUDA GPU."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; use one of {', '.join(MEASURABLE_DEVICES)}"
        ) from None
    if device.type not in MEASURABLE_DEVICES:
        raise argparse.ArgumentTypeError(
            f"cannot measure memory on {text!r}; use one of {', '.join(MEASURABLE_DEVICES)}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}, but torch sees no CUDA GPU; use cpu")
    return device


def refuse_unavailable(command: str, names: Iterable[str] | None, device: torch.device) -> bool:
    """True, after saying why on stderr, when one of the strategies ``names`` asked for
    cannot run on ``device`` here (the command then exits 2).  Names that are no
    strategy (an SDPA baseline) are never refused."""
    reasons = (unavailable_reason(n, device) for n in names or () if n in STRATEGIES)
    reason = next((r for r in reasons if r is not None), None)
    if reason is not None:
        print(f"attngrad {command}: error: {reason}", file=sys.stderr)
    return reason is not None


def skipped(device: torch.device, interpreted: bool = False) -> list[str]:
    """One line per strategy that `attngrad.strategies.available` leaves out: its name and why."""
    chosen = available(device, interpreted)
    return [
        f"{s}: skipped. {unavailable_reason(s, device) or 'Triton interpreter: too slow here.'}"
        for s in STRATEGIES
        if s not in chosen
    ]
