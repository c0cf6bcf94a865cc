"""``attngrad bench --order 2 [--loss square|dot]``: HVP and jvp against SDPA's MATH.

The measurements: `attngrad.tools.bench_hvp` (a Hessian-vector product by double
backward, time and peak, and torch.func.jvp against the forward).  This module runs
them for ``bench`` and shows them: `order2_table`, the CSV records and the plot.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import torch

from attngrad.cli.args import calibrate, sizes
from attngrad.cli.table import columns, destination, figure, write_csv, write_file
from attngrad.core.contract import DTYPES
from attngrad.core.progress import Progress
from attngrad.tools import bench_hvp
from attngrad.tools.bench_hvp import Order2Row
from attngrad.tools.machine import Machine
from attngrad.tools.memory import format_bytes
from attngrad.tools.paths import BASELINES
from attngrad.tools.timing import spread_warning

__all__ = ["order2_plot", "order2_records", "order2_table", "run_order2"]


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def order2_table(rows: Sequence[Order2Row], machine: Machine) -> str:
    """The machine, then per (N, causal) the hvp rows (time, ratio, peaks) and the
    forward/jvp rows (both times, jvp/forward, jvp vs sdpa-math's jvp)."""
    if not rows:
        return machine.line() + "\n(no measurements)"
    first = rows[0]
    out = [
        machine.line(),
        f"B={first.batch} H={first.heads} d={first.head_dim} {first.dtype}, median and "
        f"min–max of {first.repeats} rounds (after 1 warm-up), contenders interleaved",
        f"hvp: {bench_hvp.LOSS_TEXT[first.loss]}; g = grad(L, (q,k,v), create_graph=True); "
        "hvp = grad(<g, w>, (q,k,v)), one call",
        "jvp: torch.func.jvp(attention, (q,k,v), tangents) vs attention(q,k,v) alone, "
        "no autograd graph",
        f"vs {bench_hvp.BASELINE} = median / {bench_hvp.BASELINE}'s median (below 1: faster), (min) = the same "
        "of the fastest rounds; beyond I/O = peak - (O + the 3 HVP results)",
    ]
    blocks = list(dict.fromkeys((r.seq, r.causal) for r in rows))
    for n, causal in blocks:
        mine = [r for r in rows if (r.seq, r.causal) == (n, causal)]
        hv = [r for r in mine if r.measure == "hvp"]
        cells = [
            [r.contender, _ms(r.time_s), f"{_ms(r.low_s)}–{_ms(r.high_s)}", _ratio(r.ratio),
             _ratio(r.ratio_of_min), format_bytes(r.peak), format_bytes(r.peak_beyond_io)]
            for r in hv
        ]  # fmt: skip
        header = ["hvp", "median ms", "min–max ms", f"vs {bench_hvp.BASELINE}", "(min)", "peak"]
        header.append("beyond I/O")
        head, lines = columns(header, cells, left=1)
        out += ["", f"N={n} causal={'yes' if causal else 'no'}", head, *lines]
        fwd = {r.contender: r for r in mine if r.measure == "forward"}
        jv = [r for r in mine if r.measure == "jvp"]
        if jv:
            cells = [
                [r.contender, _ms(fwd[r.contender].time_s), _ms(r.time_s),
                 _ratio(r.jvp_over_forward), _ratio(fwd[r.contender].ratio), _ratio(r.ratio)]
                for r in jv
            ]  # fmt: skip
            header = ["jvp", "forward ms", "jvp ms", "jvp/forward"]
            header += [f"fwd vs {bench_hvp.BASELINE}", f"jvp vs {bench_hvp.BASELINE}"]
            head, lines = columns(header, cells, left=1)
            out += ["", head, *lines]
    return "\n".join(out)


def order2_records(rows: Sequence[Order2Row]) -> list[dict[str, object]]:
    """CSV records: one per row, times in ms, bytes as integers ('' when absent)."""

    def opt(x: float | int | None, fmt: str = ".6g") -> str:
        return "" if x is None else format(x, fmt)

    return [
        {
            "batch": r.batch, "heads": r.heads, "seq": r.seq, "head_dim": r.head_dim,
            "dtype": r.dtype, "causal": r.causal, "loss": r.loss, "measure": r.measure,
            "contender": r.contender, "repeats": r.repeats,
            "median_ms": f"{r.time_s * 1e3:.6g}", "min_ms": f"{r.low_s * 1e3:.6g}",
            "max_ms": f"{r.high_s * 1e3:.6g}", "ratio_vs_sdpa_math": opt(r.ratio),
            "ratio_of_min_vs_sdpa_math": opt(r.ratio_of_min),
            "jvp_over_forward": opt(r.jvp_over_forward), "peak_bytes": opt(r.peak, "d"),
            "peak_beyond_io_bytes": opt(r.peak_beyond_io, "d"),
        }
        for r in rows
    ]  # fmt: skip


def order2_plot(rows: Sequence[Order2Row], path: str | os.PathLike[str], machine: Machine) -> None:
    """A PNG, one column per causal mode: HVP time, HVP peak (when measured) and
    jvp/forward against N, one line per contender."""
    if not rows:
        raise ValueError("order2_plot needs at least one Order2Row, got none")
    causal_modes = sorted({r.causal for r in rows})
    contenders = list(dict.fromkeys(r.contender for r in rows))
    seqs = sorted({r.seq for r in rows})
    panels: list[tuple[str, str, Callable[[Order2Row], float | None]]] = [
        ("hvp", "HVP median time (s)", lambda r: r.time_s),
    ]
    if any(r.peak is not None for r in rows):
        panels.append(("hvp", "HVP peak memory (MiB)", lambda r: (r.peak or 0) / 2**20 or None))
    panels.append(("jvp", "jvp time / forward time", lambda r: r.jvp_over_forward))
    with figure(path, 4.5 * len(causal_modes) + 0.5, 3.3 * len(panels) + 0.6) as fig:
        axes = fig.subplots(len(panels), len(causal_modes), squeeze=False)
        for j, causal in enumerate(causal_modes):
            for i, (measure, label, value) in enumerate(panels):
                ax = axes[i][j]
                for name in contenders:
                    pts = [
                        (r.seq, y)
                        for r in rows
                        if r.causal == causal and r.measure == measure and r.contender == name
                        and (y := value(r)) is not None
                    ]  # fmt: skip
                    if pts:
                        style = "--" if name in BASELINES else "-"
                        ax.plot(*zip(*sorted(pts), strict=True), style, marker="o", label=name)
                ax.set_xscale("log", base=2)
                if measure == "hvp":
                    ax.set_yscale("log")
                ax.set_xticks(seqs, labels=[str(n) for n in seqs])
                ax.minorticks_off()
                ax.set_title(f"causal={'yes' if causal else 'no'}")
                ax.set_xlabel("N")
                ax.set_ylabel(label)
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize="small")
        r = rows[0]
        fig.suptitle(
            f"attngrad bench --order 2 ({bench_hvp.LOSS_TEXT[r.loss]}): B={r.batch} H={r.heads} "
            f"d={r.head_dim} {r.dtype}\n{machine.line()}"
        )


def run_order2(args: argparse.Namespace, strategies: list[str], causal_modes: list[bool]) -> int:
    """``bench --order 2``: the HVP and jvp of each strategy against SDPA's MATH.
    Returns the exit status."""
    wrong = [b for b in args.baseline or () if b != bench_hvp.BASELINE]
    if wrong:
        print(
            f"attngrad bench: error: --order 2 compares with SDPA's math backend only (the one "
            f"with a double backward on CPU), got --baseline {wrong[0]}; drop it",
            file=sys.stderr,
        )
        return 2
    contenders = [*strategies, bench_hvp.BASELINE]
    dtype = DTYPES[args.dtype]
    machine = calibrate(dtype, torch.device("cpu"), args.gemm_time)
    notes: list[str] = []
    with Progress(bench_hvp.steps(args.seq, causal_modes, args.repeats), "bench --order 2") as bar:
        rows = bench_hvp.run_order2(
            args.seq,
            causal_modes,
            contenders,
            **sizes(args, "batch", "heads", "head_dim"),
            dtype=dtype,
            repeats=args.repeats,
            loss=args.loss,
            peak=not args.no_peak,
            step=bar.step,
            note=notes.append,
        )
    for line in notes:
        print(line, file=sys.stderr)
    print(order2_table(rows, machine))
    warning = spread_warning(
        [(f"{r.measure} {r.contender} N={r.seq}{' causal' * r.causal}", r.time_s, r.low_s,
          r.high_s) for r in rows]
    )  # fmt: skip
    if warning is not None:
        print("\n" + warning)
    csv_path = destination(args.csv, "results/bench_hvp.csv")
    write_file(csv_path, lambda path: write_csv(order2_records(rows), path, machine))
    plot_path = destination(args.plot, "results/bench_hvp.png")
    write_file(plot_path, lambda path: order2_plot(rows, path, machine))
    return 0
