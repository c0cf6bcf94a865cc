"""``attngrad build [--force] [--json PATH|-]``: compile strategy "fused"'s C++ kernels now.

The kernels are otherwise compiled on first use (`attngrad.strategies.fused.build`);
this builds them ahead of time -- for a machine image, before a timed run, in CI --
and prints where the library went, the tile products' engine (the one whose small
attention call ran fastest) and each engine's product rate.  ``--force`` deletes
this machine's build first: it compiles and measures again.  Exit 0 when the library loads, 2 when it cannot be built here (the
message says what to install).  Wired into the ``attngrad`` command by `add_build`.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from attngrad.cli.table import write_json

__all__ = ["add_build", "run_build"]


def run_build(args: argparse.Namespace) -> int:
    """The ``build`` command: returns the exit status."""
    from attngrad.strategies.fused import build

    directory = build.library_dir()
    if args.force and directory.exists():
        shutil.rmtree(directory)
    try:
        with build.because("`attngrad build` builds strategy 'fused''s C++ kernels"):
            library = build.load()
    except build.BuildError as e:
        print(f"attngrad build: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"fused CPU kernels: {library.path}", file=out)
    rates = ", ".join(f"{name} {rate:.1f}" for name, rate in library.rates.items())
    print(f"tile products: {library.engine} (the fastest small attention call)", file=out)
    print(f"their rates, GFLOP/s on one thread, the slowest tile shape: {rates}", file=out)
    fastest = max(library.rates.values())
    reaches = (
        "the fastest engine ran faster than it, so the machine was busy while the peak was "
        "probed: `attngrad build --force` on a quiet machine measures both again"
        if fastest > library.peak
        else f"the fastest engine reaches {fastest / library.peak:.0%} of it"
    )
    print(
        f"float32 FMA peak of one core ({build.capability()}): {library.peak:.1f} GFLOP/s; "
        + reaches,
        file=out,
    )
    if args.json:
        report = {
            "library": str(library.path),
            "capability": build.capability(),
            "engine": library.engine,
            "rates_gflops": library.rates,
            "fma_peak_gflops": library.peak,
        }
        write_json(report, args.json, out)
    return 0


def add_build(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``build`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "build",
        help="compile the fused strategy's C++ CPU kernels now (else on first use)",
        description=(
            "Compile strategy 'fused''s C++ kernels with torch.utils.cpp_extension into the "
            "cache ($ATTNGRAD_CACHE_DIR, else ~/.cache/attngrad), once per torch version and "
            "CPU, and print where the library went and which engine runs the tile products. "
            "Exit 2 when they cannot be built here."
        ),
    )
    p.add_argument(
        "--force", action="store_true", help="delete this machine's build and compile again"
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.set_defaults(run=run_build)
