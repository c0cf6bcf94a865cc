"""What the ``attngrad`` commands accept: argparse types, the flags several commands
share, the strategy refusals and the machine calibration they run first.

An argparse type raises `argparse.ArgumentTypeError`; argparse then exits 2 with
``argument --NAME: <message>``, so each message shows the value and a fix.  A strategy
that exists but cannot run here is refused after parsing, also with exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch

from attngrad.core.contract import DTYPES, dtype_name
from attngrad.strategies import STRATEGIES, available, unavailable_reason
from attngrad.strategies.fused.build import because
from attngrad.tools.machine import Machine, probe
from attngrad.tools.paths import baseline_name

__all__ = [
    "add_machine_and_files",
    "add_size",
    "add_sizes",
    "add_strategy",
    "calibrate",
    "chosen_strategies",
    "measure_device",
    "positive_float",
    "positive_int",
    "sdpa_baseline",
    "sizes",
]

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


def sdpa_baseline(text: str) -> str:
    """An SDPA baseline: ``sdpa-math`` or ``sdpa-flash``, also taken as ``math``, ``flash``."""
    try:
        return baseline_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    (an SDPA baseline) are never refused.  A strategy that must be built first (fused's
    kernels, once per machine) is built here, before the command's own work starts."""
    with because(f"`attngrad {command}` runs strategy 'fused'"):
        reasons = [unavailable_reason(n, device) for n in asked or () if n in STRATEGIES]
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


# ---------------------------------------------------------- flags shared by commands


def add_size(p: argparse.ArgumentParser, flag: str, default: int, help: str) -> None:
    p.add_argument(flag, type=positive_int, default=default, help=help)


def add_strategy(p: argparse.ArgumentParser, choices: Collection[str], help: str) -> None:
    p.add_argument("--strategy", action="append", choices=choices, help=help)


def add_sizes(p: argparse.ArgumentParser, heads: int, head_dim: int) -> None:
    """``--batch``, ``--heads``, ``--head-dim`` and ``--dtype``, alike on every command."""
    add_size(p, "--batch", 1, "batch B (default 1)")
    add_size(p, "--heads", heads, f"query heads H (default {heads})")
    add_size(p, "--head-dim", head_dim, f"head dim d (default {head_dim})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default float32)")


def add_machine_and_files(p: argparse.ArgumentParser, stem: str, when: str) -> None:
    """``--gemm-time``, ``--csv`` and ``--plot``, alike on bench and ledger."""
    p.add_argument(
        "--gemm-time",
        type=positive_float,
        default=0.2,
        metavar="SECONDS",
        help="grow the GEMM that measures the matmul rate until one product takes about "
        "this long (default 0.2)",
    )
    p.add_argument(
        "--csv", metavar="PATH", help=f"write the rows here ('' to skip; default {when}{stem}.csv)"
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help=f"write a PNG plot here ('' to skip; default {when}{stem}.png)",
    )


def sizes(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The size flags ``names`` as keyword arguments (``--head-dim`` is ``head_dim``)."""
    return {name: getattr(args, name) for name in names}


def calibrate(dtype: torch.dtype, device: torch.device, budget: float) -> Machine:
    """`attngrad.tools.machine.probe`, each calibration step shown on stderr."""
    name = dtype_name(dtype)
    print(f"calibrating the {name} matmul rate ({budget:g} s per GEMM)...", file=sys.stderr)

    def note(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    return probe(dtype, device, budget, note=note)
