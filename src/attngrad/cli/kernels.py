"""``attngrad kernels --target sm_90|sm_80 [--json PATH|-] [--quick] [--summary] [--markdown]``.

The compile report (`attngrad.tools.kernel_report`): every kernel configuration the
triton strategy launches, compiled for the target without a GPU.  Exit 0 when
every configuration is ok, 1 when one spills or overruns shared memory (or
does not compile), 2 when the report cannot run here (no Triton, or Triton's
interpreter: the report needs the compiler).  Wired into the ``attngrad``
command by `add_kernels`; `kernels_table` shows the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from attngrad.cli import table
from attngrad.cli.args import positive_int
from attngrad.cli.table import write_json
from attngrad.core.progress import Progress

if TYPE_CHECKING:
    from attngrad.tools.kernel_report import Row

__all__ = ["add_kernels", "kernels_table", "run_kernels"]

_COLUMNS = (
    "kernel", "dtype", "d", "mask", "tiles", "warps", "stages", "shared B", "regs", "spill B", "verdict",
)  # fmt: skip


def _cells(row: Row) -> tuple[str, ...]:
    v, r = row.variant, row.resources
    tiles = f"{row.block_m}" if row.kernel == "delta" else f"{row.block_m}x{row.block_n}"
    if 0 < row.chunk < v.head_dim:
        tiles += f"/{row.chunk}"  # the dots over d in slices of this many columns
    return (
        row.kernel,
        "float32+tf32" if v.precision == "tf32" else v.dtype,
        str(v.head_dim),
        v.mask
        + (f" gqa{v.groups}" if v.groups > 1 else "")
        + (f" N={v.seq}" if v.seq != 1024 else ""),
        tiles,
        str(row.num_warps),
        str(row.num_stages),
        str(r.shared_bytes),
        str(r.registers),
        str(r.spill_stores),
        row.verdict,
    )


def kernels_table(rows: list[Row], markdown: bool = False) -> str:
    """The rows as an aligned text table (or a Markdown one), then a summary line."""
    cells = [_cells(row) for row in rows]
    if markdown:
        lines = table.markdown(_COLUMNS, cells)
    else:
        head, body = table.columns(_COLUMNS, cells, left=len(_COLUMNS))
        lines = [head, *body]
    failed = sum(not row.ok for row in rows)
    target = rows[0].target if rows else None
    name = target.name if target else "?"
    limit = f", shared limit {target.shared_limit} B per block" if target else ""
    lines.append(f"\n{name}: {len(rows)} rows, {failed} not ok{limit}")
    return "\n".join(lines)


def _cannot_run() -> str | None:
    """Why the report cannot compile here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "needs Triton's compiler, and Triton is not installed: pip install 'attngrad[gpu]'"
    from attngrad.strategies.triton import kernels

    if kernels.INTERPRETED:
        return (
            "needs Triton's compiler, but TRITON_INTERPRET=1 runs the kernels in the interpreter: "
            "run it with TRITON_INTERPRET unset or 0 (no GPU is needed)"
        )
    return None


def run_kernels(args: argparse.Namespace) -> int:
    """The ``kernels`` command: returns the exit status."""
    reason = _cannot_run()
    if reason is not None:
        print(f"attngrad kernels: {reason}", file=sys.stderr)
        return 2
    from attngrad.strategies.triton import configs
    from attngrad.strategies.triton.ptxas import UnsupportedTriton, default_cache_dir
    from attngrad.tools import kernel_report

    target = kernel_report.TARGETS[args.target]
    variants = kernel_report.grid(quick=args.quick)
    cache = None if args.no_cache else (args.cache_dir or default_cache_dir())
    try:
        planned = kernel_report.plan(target, variants)
        with Progress(len(planned.distinct), f"kernels {target.name}") as bar:
            rows = kernel_report.report(planned, args.jobs, cache, bar.step)
    except UnsupportedTriton as e:
        print(f"attngrad kernels: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout  # with --json -, stdout is the JSON alone
    triton = configs.triton_version_text()
    print(f"attngrad kernels --target {target.name} (Triton {triton}'s table)", file=out)
    shown = kernel_report.summary(rows) if args.summary else rows
    print(kernels_table(shown, markdown=args.markdown), file=out)
    if args.summary:
        failed = sum(not row.ok for row in rows)
        print(f"over all {len(rows)} configurations: {failed} not ok", file=out)
    if not configs.compiles(float64=True, keep_mask=True):
        print(
            f"float64 with a bool mask left out: Triton {triton} cannot compile it "
            "(strategy='triton' refuses the call)",
            file=out,
        )
    if args.json:
        write_json(kernel_report.as_json(target, rows), args.json, out)
    return 0 if all(row.ok for row in rows) else 1


def add_kernels(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``kernels`` subcommand to ``attngrad``'s subparsers."""
    from attngrad.tools.kernel_report import TARGETS

    p = sub.add_parser(
        "kernels",
        help="compile every triton kernel configuration for a GPU target, without a GPU",
        description=(
            "Compile, for a CUDA target and without a GPU, every kernel configuration the "
            "triton strategy launches (dtypes and dot precisions, head dims 64, 80, 128, 256, "
            "every mask mode, GQA) with Triton and its ptxas; report tiles, warps, stages, "
            "shared memory, registers and spills. Exit 1 when one spills or uses more than 90%% "
            "of the target's shared memory per block; 2 when it cannot run here."
        ),
    )
    p.add_argument("--target", required=True, choices=sorted(TARGETS), help="the GPU architecture")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="only the configurations that decide the tiles: mode 'all' (every mask feature) "
        "with GQA, float16 and float32, head dims 64, 128, 256",
    )
    p.add_argument("--jobs", type=positive_int, help="compiler processes (default: the CPUs)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where compiled results are kept between runs (default: $ATTNGRAD_CACHE_DIR, "
        "else ~/.cache/attngrad, then /kernels)",
    )
    p.add_argument("--no-cache", action="store_true", help="compile everything again")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print one row per kernel, dtype, head dim and tier (light: the mask modes; heavy: "
        "softcap or dropout), the worst of its modes (--json still has every configuration)",
    )
    p.set_defaults(run=run_kernels)
