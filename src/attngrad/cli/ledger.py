"""``attngrad ledger [--seq-q N ...] [--sweep N ...] [--strategy NAME ...] [--order 1|2]``.

The memory ledger (`attngrad.tools.ledger`): saved bytes, predicted and measured, and
the peak memory of every path; with ``--order 2`` what a double backward keeps.  This
module runs it and shows it: the tables (`ledger_table`, `second_order_table`), the
CSV records and the plot.  Exit 1 when a prediction misses, 2 when a strategy asked for
cannot run here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TypeVar

import torch

from attngrad.cli.args import (
    add_machine_and_files,
    add_size,
    add_sizes,
    add_strategy,
    calibrate,
    chosen_strategies,
    measure_device,
    positive_int,
)
from attngrad.cli.table import columns, destination, figure, write_csv, write_file, yes
from attngrad.core.contract import DTYPES, Shapes, pair
from attngrad.core.progress import Progress
from attngrad.strategies import STRATEGIES
from attngrad.tools import ledger
from attngrad.tools.ledger import LedgerRow, SecondOrderRow
from attngrad.tools.machine import Machine
from attngrad.tools.memory import format_bytes
from attngrad.tools.paths import SDPA_BASELINES
from attngrad.verify.cases import Case

__all__ = [
    "add_ledger",
    "ledger_plot",
    "ledger_records",
    "ledger_table",
    "run_ledger",
    "second_order_records",
    "second_order_table",
]


def ledger_records(rows: Sequence[LedgerRow]) -> list[dict[str, object]]:
    """CSV records: every `LedgerRow` field (bytes) and ``match``."""
    return [{**asdict(r), "match": r.match} for r in rows]


def ledger_table(rows: Sequence[LedgerRow], machine: Machine) -> str:
    """The machine, then one row per path and layout."""
    cells = [
        [
            r.path,
            *_layout_cells(r),
            format_bytes(r.predicted_saved),
            format_bytes(r.measured_saved),
            {None: "-", True: "yes", False: "NO"}[r.match],
            format_bytes(r.peak),
            format_bytes(r.peak_beyond_io),
        ]
        for r in rows
    ]
    header = ["path", "B", "H", "Nq x Nk", "d", "dtype", "causal", "predicted saved"]
    header += ["measured saved", "match", "peak fwd+bwd", "beyond I/O"]
    head, lines = columns(header, cells, left=1)
    return "\n".join([machine.line(), head, "-" * len(head), *lines])


def _layout_cells(r: LedgerRow | SecondOrderRow) -> list[str]:
    """B, H, Nq x Nk, d, dtype, causal of a ledger row."""
    return [
        str(r.batch),
        pair(r.heads_q, r.heads_kv, ":"),
        pair(r.seq_q, r.seq_k, " x "),
        pair(r.head_dim, r.value_dim, ":"),
        r.dtype,
        yes(r.causal),
    ]


def second_order_records(rows: Sequence[SecondOrderRow]) -> list[dict[str, object]]:
    """CSV records: every `attngrad.tools.ledger.SecondOrderRow` field (bytes)."""
    return [asdict(r) for r in rows]


def second_order_table(rows: Sequence[SecondOrderRow], machine: Machine) -> str:
    """The machine, a line on what is measured, then one row per path and layout: bytes
    saved by forward and by the create_graph backward, what both keep until the second
    backward, the Hessian-vector product's peak; under the table why a path has no
    double backward."""
    cells = [
        [
            r.path,
            *_layout_cells(r),
            yes(r.supported),
            format_bytes(r.forward_saved),
            format_bytes(r.backward_saved),
            format_bytes(r.kept),
            format_bytes(r.peak),
            format_bytes(r.peak_beyond_io),
        ]
        for r in rows
    ]
    header = ["path", "B", "H", "Nq x Nk", "d", "dtype", "causal", "2nd order", "fwd saved"]
    header += ["create_graph bwd saved", "kept to 2nd bwd", "peak HVP", "beyond I/O"]
    head, lines = columns(header, cells, left=1)
    about = (
        "second order: g = grad(O, (q, k, v), dO, create_graph=True), then the "
        "Hessian-vector product grad(<g, w>, (q, k, v)); kept = what forward and that "
        "backward save, each storage once (held until the second backward)"
    )
    notes = [f"{r.path}: no double backward ({r.note})" for r in rows if not r.supported]
    return "\n".join([machine.line(), about, head, "-" * len(head), *lines, *notes])


def ledger_plot(rows: Sequence[LedgerRow], path: str | os.PathLike[str], machine: Machine) -> None:
    """Two log-log panels against N, one line per path: saved bytes (predicted as hollow
    circles where a formula exists) and, when measured, the peak of forward+backward."""
    if not rows:
        raise ValueError("ledger_plot needs at least one LedgerRow, got none")
    panels = [("bytes saved for backward", "measured_saved")]
    if all(r.peak is not None for r in rows):
        panels.append(("peak of forward+backward", "peak"))
    markers = "osD^vx"
    with figure(path, 6.5 * len(panels), 5.0) as fig:
        axes = fig.subplots(1, len(panels), squeeze=False)
        for ax, (label, field_name) in zip(axes[0], panels, strict=True):
            for i, name in enumerate(dict.fromkeys(r.path for r in rows)):
                mine = [r for r in rows if r.path == name]
                n = [r.seq_q for r in mine]
                # paths that save the same bytes overlap: thinner lines on top keep each visible
                (line,) = ax.plot(
                    n,
                    [getattr(r, field_name) for r in mine],
                    marker=markers[i % len(markers)],
                    lw=3.0 - 0.4 * i,
                    ms=7 - i,
                    label=name,
                )
                predicted = [r.predicted_saved for r in mine if r.predicted_saved is not None]
                if field_name == "measured_saved" and len(predicted) == len(mine):
                    ax.plot(n, predicted, ls="none", marker="o", ms=12, mfc="none",
                            color=line.get_color(), alpha=0.5)  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("sequence length N (Nq = Nk)")
            ax.set_ylabel(label + " (bytes)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        r = rows[0]
        fig.suptitle(
            f"attngrad ledger: B={r.batch} H={pair(r.heads_q, r.heads_kv, ':')} "
            f"d={r.head_dim} {r.dtype}   (hollow circles: predicted by the saved-bytes "
            f"formulas)\n{machine.line()}"
        )


def _layout(args: argparse.Namespace, seq_q: int, seq_k: int) -> Case:
    heads_kv = args.heads_kv or args.heads
    shapes = Shapes(
        (args.batch,), args.heads, heads_kv, seq_q, seq_k, args.head_dim,
        args.value_dim or args.head_dim,
    )  # fmt: skip
    return Case(shapes, DTYPES[args.dtype], "causal" if args.causal else "none")


def run_ledger(args: argparse.Namespace) -> int:
    """The ``ledger`` command: returns the exit status."""
    device: torch.device = args.device
    strategies = chosen_strategies("ledger", args.strategy, device, interpreted=False)
    if strategies is None:
        return 2
    paths = strategies if args.strategy else [*strategies, *SDPA_BASELINES]
    sizes = [(n, n) for n in args.sweep] if args.sweep else [(args.seq_q, args.seq_k or args.seq_q)]
    layouts = [_layout(args, seq_q, seq_k) for seq_q, seq_k in sizes]
    machine = calibrate(DTYPES[args.dtype], device, args.gemm_time)
    if args.order == 2:
        return _second_order(args, paths, layouts, machine)
    rows = _measured(ledger.run_ledger, args, paths, layouts)
    if rows is None:
        return 2
    print(ledger_table(rows, machine))
    sweep_default = "results/ledger.{}" if args.sweep else None
    if rows:  # none when every path asked for is a baseline that rejected the case
        csv_path = destination(args.csv, sweep_default and sweep_default.format("csv"))
        write_file(csv_path, lambda path: write_csv(ledger_records(rows), path, machine))
        plot_path = destination(args.plot, sweep_default and sweep_default.format("png"))
        write_file(plot_path, lambda path: ledger_plot(rows, path, machine))
        if args.plot is None and not args.sweep:
            print(
                "no plot for one size: --sweep N [N ...] writes results/ledger.png (bytes "
                "against N), --plot PATH this size's",
                file=sys.stderr,
            )
    mismatched = [r for r in rows if r.match is False]
    for r in mismatched:
        print(
            f"MISMATCH {r.path} N={r.seq_q}: predicted {r.predicted_saved} measured {r.measured_saved}"
        )
    return 1 if mismatched else 0


Row = TypeVar("Row")


def _measured(
    run: Callable[..., tuple[list[Row], list[str]]],
    args: argparse.Namespace,
    paths: Sequence[str],
    layouts: Sequence[Case],
) -> list[Row] | None:
    """The rows of ``run`` (`ledger.run_ledger` or its second-order twin) over every path and
    layout with a progress bar, its notes on stderr; None after printing the error of a
    case it refuses."""
    try:
        with Progress(len(paths) * len(layouts), "ledger") as bar:
            rows, notes = run(
                paths, layouts, str(args.device), peak=not args.no_peak, step=bar.step
            )
    except (ValueError, TypeError) as e:
        print(f"attngrad ledger: error: {e}", file=sys.stderr)
        return None
    for line in notes:
        print(line, file=sys.stderr)
    return rows


def _second_order(
    args: argparse.Namespace, paths: Sequence[str], layouts: Sequence[Case], machine: Machine
) -> int:
    """``ledger --order 2``: the double-backward table, and its CSV (no plot)."""
    rows = _measured(ledger.run_second_order_ledger, args, paths, layouts)
    if rows is None:
        return 2
    print(second_order_table(rows, machine))
    sweep_default = "results/ledger_order2.csv" if args.sweep else None
    csv_path = destination(args.csv, sweep_default)
    if rows:
        records = second_order_records(rows)
        write_file(csv_path, lambda path: write_csv(records, path, machine))
    if args.plot:
        print(f"skipped the plot {args.plot}: --order 2 writes no plot", file=sys.stderr)
    return 0


def add_ledger(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ledger`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "ledger",
        help="saved bytes (predicted vs measured) and peak memory of every path",
        description=(
            "What each path saves between forward and backward, predicted from the "
            "strategies' saved-bytes formulas and measured, and the peak memory of "
            "forward+backward, beside SDPA's MATH and FLASH_ATTENTION backends.  Exit 1 "
            "when a prediction misses."
        ),
    )
    add_sizes(p, heads=8, head_dim=64)
    p.add_argument("--heads-kv", type=positive_int, help="key/value heads Hkv for GQA (default H)")
    add_size(p, "--seq-q", 1024, "query length Nq (default 1024)")
    p.add_argument("--seq-k", type=positive_int, help="key length Nk (default Nq)")
    p.add_argument("--value-dim", type=positive_int, help="value head dim dv (default d)")
    p.add_argument("--causal", action="store_true", help="is_causal=True")
    p.add_argument(
        "--device",
        type=measure_device,
        default=torch.device("cpu"),
        help="cpu, or cuda with a CUDA GPU (default cpu)",
    )
    add_strategy(
        p,
        (*STRATEGIES, *SDPA_BASELINES),
        "a strategy or SDPA backend (repeatable; default every one that runs here)",
    )
    p.add_argument("--no-peak", action="store_true", help="skip the peak-memory runs (faster)")
    p.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: forward+backward (default); 2: double backward: what the create_graph=True "
        "backward saves, what a gradient penalty keeps and a Hessian-vector product's peak "
        "(CSV with --sweep: results/ledger_order2.csv; no plot)",
    )
    p.add_argument(
        "--sweep",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="run over these N (Nq = Nk) instead of --seq-q/--seq-k; writes CSV and PNG",
    )
    add_machine_and_files(p, "results/ledger", "with --sweep: ")
    p.set_defaults(run=run_ledger)
