"""The ``attngrad`` command (also ``python -m attngrad``): assembles the parser from
one module per command and runs the one asked for.

attngrad check   [--strategy NAME ...] [--json PATH|-] [--csv PATH] [--failures] [--seed N]
                 [--no-gradcheck]
                 the conformance grid; exit 1 on a failed case, 2 on a strategy that can't run
attngrad ledger  [--seq-q N ...] [--sweep N ...] [--strategy NAME ...] [--order 1|2]
                 saved bytes and peak memory per path; exit 1 when a prediction misses
attngrad explain [--strategy NAME ...] [--order 1|2]  the grad_fn graph and saved tensors per path
attngrad bench   [--seq N ...] [--strategy NAME]   time against SDPA's MATH and FLASH backends
attngrad bench --order 2 [--loss square|dot]     HVP (double backward) and jvp vs SDPA MATH
attngrad bench --features [--device cpu|cuda]    dropout, packed, softcap, sinks: time ratios
attngrad verify  MODULE:FUNCTION [--json PATH|-] [--seed N] [--no-gradcheck]
                 judge any SDPA-signature function; exit 1 on a failure, 2 when it can't be loaded
attngrad exercise DIR [--lang zh|en] [--force]   write the attention-backward exercise
attngrad grade FILE [--json PATH] [--timeout S]  grade a solution; exit 0 when every stage passes
attngrad kernels --target sm_90|sm_80 [--json PATH|-] [--quick]
                 compile every triton kernel configuration for the GPU, without one: registers,
                 spills, shared memory; exit 1 on a spill or overrun, 2 when it can't compile here
attngrad build   [--force] [--json PATH|-]         compile the fused strategy's C++ CPU kernels
                 now (else on first use); exit 2 when they cannot be built here
attngrad --version

Each command lives in ``attngrad.cli.<command>`` (``bench --order 2`` and ``--features``
in `attngrad.cli.bench_hvp` and `attngrad.cli.bench_features`): its flags
(``add_<command>``), its run, and how its rows are shown, through the one writer of
tables, CSV, JSON and plots, `attngrad.cli.table`.  The rows themselves come from
`attngrad.verify`, `attngrad.tools` and `attngrad.learn`.  ``--csv ''`` and
``--plot ''`` skip that file.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import attngrad
from attngrad.cli.bench import add_bench
from attngrad.cli.build import add_build
from attngrad.cli.check import add_check
from attngrad.cli.exercise import add_exercise
from attngrad.cli.explain import add_explain
from attngrad.cli.grade import add_grade
from attngrad.cli.kernels import add_kernels
from attngrad.cli.ledger import add_ledger
from attngrad.cli.verify import add_verify

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngrad",
        description=(
            "Attention with hand-written backward passes: check every strategy against "
            "float64, account for its memory, explain its graph, time it."
        ),
    )
    parser.add_argument("--version", action="version", version=f"attngrad {attngrad.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        add_check,
        add_ledger,
        add_explain,
        add_bench,
        add_verify,
        add_exercise,
        add_grade,
        add_kernels,
        add_build,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.run(args))
