"""What the ``attngrad`` commands accept: argparse types and the strategy refusals.

An argparse type raises `argparse.ArgumentTypeError`; argparse then exits 2 with
``argument --NAME: <message>``, so each message shows the value and a fix.  A strategy
that exists but cannot run here is refused after parsing, also with exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TextIO, TypeVar

import torch

from attngrad.strategies import STRATEGIES, available, unavailable_reason

__all__ = ["chosen_strategies", "measure_device", "positive_float", "positive_int"]

N = TypeVar("N", int, float)

# Where the ledger can count bytes: the profiler's allocation events on CPU, the
# allocator's peak counter on CUDA.
MEASURABLE_DEVICES = ("cpu", "cuda")


def _positive(text: str, convert: Callable[[str], N], what: str) -> N:
    """``convert(text)`` when it gives a finite number > 0, else a message saying ``what``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """A size or a count: an int >= 1, e.g. ``--seq 1024`` or ``--repeats 5``."""
    return _positive(text, int, "a whole number of 1 or more, e.g. 5")


def positive_float(text: str) -> float:
    """A duration in seconds: a finite float > 0, e.g. ``--gemm-time 0.2``."""
    return _positive(text, float, "a positive number of seconds, e.g. 0.2")


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


def chosen_strategies(
    command: str, asked: list[str] | None, device: torch.device, interpreted: bool
) -> list[str] | None:
    """The strategies a command runs: those ``asked`` for, or every one `available` on
    ``device`` (saying on stderr which are skipped and why); None, after saying why, when
    one asked for cannot run here (the command then exits 2).  Names that are no strategy
    (an SDPA baseline) are never refused."""
    reasons = (unavailable_reason(n, device) for n in asked or () if n in STRATEGIES)
    refused = next((r for r in reasons if r is not None), None)
    if refused is not None:
        print(f"attngrad {command}: error: {refused}", file=sys.stderr)
        return None
    if asked:
        return list(dict.fromkeys(asked))
    chosen = available(device, interpreted)
    for s in STRATEGIES:
        if s not in chosen:
            reason = unavailable_reason(s, device) or "Triton interpreter: too slow here."
            print(f"{s}: skipped. {reason}", file=sys.stderr)
    return list(chosen)


def write_json(payload: object, path: str, out: TextIO) -> None:
    """``payload`` as indented JSON to ``path``, or to stdout when it is "-" (notes go to ``out``)."""
    text = json.dumps(payload, indent=2, ensure_ascii=False)
    if path == "-":
        print(text)
        return
    with open(path, "w", encoding="utf-8") as f:  # utf-8: the grader's hints and Chinese text
        f.write(text)
    print(f"wrote {path}", file=out)
