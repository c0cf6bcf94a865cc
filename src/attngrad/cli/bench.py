"""``attngrad bench [--seq N ...] [--strategy NAME] [--baseline NAME]``, with
``--order 2`` (`attngrad.cli.bench_hvp`) and ``--features`` (`attngrad.cli.bench_features`).

Forward, backward and forward+backward time of each strategy against SDPA's own
backends (`attngrad.tools.bench_step`), interleaved in one process.  This module owns
the command's flags, runs the plain bench and shows it: `bench_table`, the CSV
records and the plot.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    sdpa_baseline,
    sizes,
)
from attngrad.cli.bench_features import run_features
from attngrad.cli.bench_hvp import run_order2
from attngrad.cli.table import columns, destination, figure, write_csv, write_file, yes
from attngrad.core.contract import DTYPES
from attngrad.core.progress import Progress
from attngrad.strategies import STRATEGIES
from attngrad.tools import bench_features, bench_hvp, bench_step
from attngrad.tools.bench_step import PASSES, BenchRow
from attngrad.tools.machine import BUSY, BUSY_NOTE, Machine
from attngrad.tools.paths import BASELINES, SDPA_BASELINES
from attngrad.tools.timing import spread_warning

__all__ = ["add_bench", "bench_plot", "bench_records", "bench_table", "run_bench"]

_CAUSAL_MODES = {"both": [False, True], "no": [False], "yes": [True]}
# --seq's default; `run_bench` tells it from a --seq given by identity
_SEQS = [1024, 2048, 4096]


def _ratio_column(baseline: str) -> str:
    """``"sdpa-math"`` -> ``"ratio_vs_sdpa_math"``."""
    return "ratio_vs_" + baseline.replace("-", "_")


def bench_records(rows: Sequence[BenchRow]) -> list[dict[str, object]]:
    """CSV records: shape, pass, contender, median/min/max ms, GFLOP/s, fraction of the
    GEMM rate, the strategy "auto" picks, then one ``ratio_vs_<baseline>`` per baseline."""
    shape = ("batch", "heads", "seq_q", "seq_k", "head_dim", "dtype", "causal")
    return [
        {
            **{name: getattr(r, name) for name in shape},
            "pass": r.pass_,
            "contender": r.contender,
            "auto": r.auto,
            "repeats": r.repeats,
            "median_ms": f"{r.time_s * 1e3:.6g}",
            "min_ms": f"{r.low_s * 1e3:.6g}",
            "max_ms": f"{r.high_s * 1e3:.6g}",
            "gflops": f"{r.gflops:.6g}",
            "gemm_fraction": f"{r.gemm_fraction:.6g}",
            **{_ratio_column(b): f"{ratio:.6g}" for b, ratio in r.ratios.items()},
        }
        for r in rows
    ]


def _above_gemm(machine: Machine) -> str:
    """The footnote of a starred ``of GEMM``: why attention outran the measured GEMM."""
    why = (
        "16-bit inputs compute in float32 inside attention, and a CPU BLAS seldom has fast "
        f"{machine.gemm_dtype} kernels"
        if machine.gemm_dtype in ("float16", "bfloat16")
        else "that GEMM did not reach the BLAS's steady rate; a longer --gemm-time measures "
        "a larger one"
    )
    return (
        f"* above 100%: attention ran faster than the measured {machine.gemm_dtype} GEMM "
        f"({machine.gemm_gflops:.1f} GFLOP/s at {machine.gemm_size}²), so that rate "
        f"underestimates what this machine's matmuls reach here: {why}."
    )


def bench_table(rows: Sequence[BenchRow], machine: Machine) -> str:
    """The machine, then one block per (N, causal) naming the strategy "auto" picks, a
    blank line between passes; an ``of GEMM`` above 100% is starred and explained."""
    if not rows:
        return machine.line() + "\n(no measurements)"
    first = rows[0]
    baselines = list(first.ratios)
    # of ceiling: of the tile products' rate (`Machine.ceiling_gflops`); of peak: of the FMA
    # peak (`Machine.fma_gflops`), where they were measured
    ceiling = [] if machine.tile_gflops is None else ["of ceiling"]
    peak = [] if machine.fma_gflops is None else ["of peak"]
    cells = [
        [
            r.pass_,
            r.contender,
            f"{r.time_s * 1e3:.2f}",
            f"{r.low_s * 1e3:.2f}–{r.high_s * 1e3:.2f}",
            f"{r.gflops:.1f}",
            f"{r.gemm_fraction:.1%}" + ("*" if r.gemm_fraction > 1 else " "),
            *(f"{r.gflops / machine.ceiling_gflops:.1%}" for _ in ceiling),
            *(machine.of_peak(r.gflops) for _ in peak),
            *(f"{r.ratios[b]:.2f}" for b in baselines),
        ]
        for r in rows
    ]
    header = [
        "pass", "contender", "median ms", "min–max ms", "GFLOP/s", "of GEMM ", *ceiling, *peak
    ]  # fmt: skip
    head, lines = columns([*header, *(f"vs {b}" for b in baselines)], cells, left=2)
    out = [
        machine.line(),
        f"B={first.batch} H={first.heads} d={first.head_dim} {first.dtype}, median and "
        f"min–max of {first.repeats} rounds (after 1 warm-up)",
        "vs <baseline> = median time / baseline median time (below 1: faster)",
    ]
    previous: BenchRow | None = None
    for r, line in zip(rows, lines, strict=True):
        if previous is None or (r.seq_q, r.causal) != (previous.seq_q, previous.causal):
            title = f"N={r.seq_q} causal={yes(r.causal)} (strategy auto picks {r.auto})"
            out += ["", title, head]
        elif r.pass_ != previous.pass_:
            out.append("")
        out.append(line)
        previous = r
    if any(r.gemm_fraction > 1 for r in rows):
        out += ["", _above_gemm(machine)]
    if peak and any(machine.of_peak(r.gflops) == BUSY for r in rows):
        out += ["", BUSY_NOTE]
    return "\n".join(out)


def bench_plot(rows: Sequence[BenchRow], path: str | os.PathLike[str], machine: Machine) -> None:
    """A PNG: GFLOP/s against N, one panel per (causal, pass), the GEMM rate dotted."""
    if not rows:
        raise ValueError("bench_plot needs at least one BenchRow, got none")
    causal_modes = sorted({r.causal for r in rows})
    contenders = list(dict.fromkeys(r.contender for r in rows))
    seqs = sorted({r.seq_q for r in rows})
    with figure(path, 4.5 * len(PASSES), 3.5 * len(causal_modes) + 0.5) as fig:
        axes = fig.subplots(len(causal_modes), len(PASSES), squeeze=False, sharey=True)
        for i, causal in enumerate(causal_modes):
            for j, pass_ in enumerate(PASSES):
                ax = axes[i][j]
                for name in contenders:
                    pts = sorted(
                        (r.seq_q, r.gflops)
                        for r in rows
                        if r.causal == causal and r.pass_ == pass_ and r.contender == name
                    )
                    style = "--" if name in BASELINES else "-"
                    ax.plot([n for n, _ in pts], [g for _, g in pts], style, marker="o", label=name)
                ax.axhline(machine.gemm_gflops, color="grey", linestyle=":", label="GEMM rate")
                ax.set_xscale("log", base=2)
                ax.set_xticks(seqs, labels=[str(n) for n in seqs])
                ax.minorticks_off()
                ax.set_title(f"{pass_}, causal={yes(causal)}")
                ax.set_xlabel("N")
                if j == 0:
                    ax.set_ylabel("GFLOP/s")
        axes[0][0].legend(fontsize="small")
        r = rows[0]
        fig.suptitle(
            f"attngrad bench: B={r.batch} H={r.heads} d={r.head_dim} {r.dtype}\n{machine.line()}"
        )


def run_bench(args: argparse.Namespace) -> int:
    """The ``bench`` command (``--order 2``, ``--features`` included): returns the exit status."""
    if args.features:
        return run_features(args, seq_given=args.seq is not _SEQS)
    if args.device is not None:
        print("attngrad bench: error: --device goes with --features only", file=sys.stderr)
        return 2
    cpu = torch.device("cpu")
    strategies = chosen_strategies("bench", args.strategy, cpu, interpreted=False)
    if strategies is None:
        return 2
    causal_modes = _CAUSAL_MODES[args.causal]
    if args.order == 2:
        return run_order2(args, strategies, causal_modes)
    baselines = list(dict.fromkeys(args.baseline or SDPA_BASELINES))
    dtype = DTYPES[args.dtype]
    machine = calibrate(dtype, cpu, args.gemm_time)
    shape = sizes(args, "batch", "heads", "head_dim")
    seconds = bench_step.estimate_seconds(
        args.seq, causal_modes, len(strategies) + len(baselines), args.repeats,
        machine.gemm_gflops, **shape,
    )  # fmt: skip
    bar = Progress(
        bench_step.steps(args.seq, causal_modes, args.repeats),
        "bench",
        weights=bench_step.step_flops(args.seq, causal_modes, args.repeats, **shape),
        estimate=(seconds, "from the GEMM rate; the bar refines it as it goes"),
    )
    with bar:
        rows = bench_step.run_bench(
            args.seq,
            causal_modes,
            strategies,
            baselines,
            **shape,
            dtype=dtype,
            repeats=args.repeats,
            gemm_gflops=machine.gemm_gflops,
            step=bar.step,
        )
    print(bench_table(rows, machine))
    warning = spread_warning(
        [(f"{r.pass_} {r.contender} N={r.seq_q}{' causal' * r.causal}", r.time_s, r.low_s,
          r.high_s) for r in rows]
    )  # fmt: skip
    if warning is not None:
        print("\n" + warning)
    tiled = [s for s in ("fused", "flash") if s in strategies]
    if tiled and "explicit" in strategies:
        print()
        for causal in causal_modes:
            n = bench_step.crossover(rows, fast=tiled[0], causal=causal)
            where = f"from N={n}" if n is not None else "at no measured N"
            print(
                f"forward+backward, causal={'yes' if causal else 'no'}: "
                f"{tiled[0]} is faster than explicit {where}"
            )
    csv_path = destination(args.csv, "results/bench.csv")
    write_file(csv_path, lambda path: write_csv(bench_records(rows), path, machine))
    plot_path = destination(args.plot, "results/bench.png")
    write_file(plot_path, lambda path: bench_plot(rows, path, machine))
    return 0


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "bench",
        help="time each strategy against SDPA's MATH and FLASH_ATTENTION backends",
        description=(
            "Forward, backward and forward+backward time of each strategy against "
            "F.scaled_dot_product_attention under sdpa_kernel(MATH / FLASH_ATTENTION), "
            "interleaved in one process: median and min-max time, GFLOP/s, fraction of the "
            "measured GEMM rate, ratio to each baseline, and the strategy 'auto' picks."
        ),
    )
    add_sizes(p, heads=8, head_dim=64)
    p.add_argument(
        "--seq",
        type=positive_int,
        nargs="+",
        default=_SEQS,
        metavar="N",
        help="sequence lengths, Nq = Nk = N (default 1024 2048 4096; with --features 4096)",
    )
    p.add_argument(
        "--causal",
        choices=tuple(_CAUSAL_MODES),
        default="both",
        help="is_causal runs (default both)",
    )
    add_strategy(
        p,
        (*STRATEGIES, "auto"),
        "time only this strategy (repeatable; default every one that runs on CPU, with "
        "--features flash)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        type=sdpa_baseline,
        choices=SDPA_BASELINES,
        help="SDPA backend to compare with (repeatable; default sdpa-math and sdpa-flash; "
        "math and flash are taken too)",
    )
    add_size(p, "--repeats", 5, "timed rounds, after 1 warm-up (default 5)")
    p.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: forward and backward (default); 2: a Hessian-vector product by double "
        "backward (time and peak memory) and torch.func.jvp against the forward, each "
        "against SDPA's math backend (attngrad.tools.bench_hvp); its CSV and plot default to "
        "results/bench_hvp.csv and .png",
    )
    p.add_argument(
        "--loss",
        choices=bench_hvp.LOSSES,
        default="square",
        help="with --order 2, the loss whose HVP is taken: square = sum(O**2)/2 (default), "
        "dot = <O, dO> for a fixed random dO",
    )
    p.add_argument(
        "--no-peak", action="store_true", help="with --order 2, skip the HVP peak-memory runs"
    )
    fb = bench_features
    targets = ", ".join(f"{f.name} <= {f.target:g}x" for f in fb.FEATURES if f.target is not None)
    p.add_argument(
        "--features",
        action="store_true",
        help=f"forward+backward time with each of dropout_p={fb.DROPOUT_P}, {fb.SEGMENTS} "
        f"packed causal segments (cu_seqlens), softcap={fb.SOFTCAP:g} and per-head sinks over "
        "the same call without it, per strategy, all interleaved (attngrad.tools.bench_features); "
        f"targets for {fb.TARGET_STRATEGY} at N={fb.TARGET_SEQ}: {targets}; CSV and plot "
        "default to results/bench_features.csv and .png",
    )
    p.add_argument(
        "--device",
        type=measure_device,
        help="with --features: cpu (default) or cuda, where triton runs too",
    )
    add_machine_and_files(p, "results/bench", "")
    p.set_defaults(run=run_bench)
