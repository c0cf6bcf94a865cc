"""``attngrad bench --features [--device cpu|cuda]``: what each feature costs, as a ratio.

The measurements: `attngrad.tools.bench_features` (forward+backward with dropout,
packed segments, softcap and sinks over the same call without).  This module runs
them for ``bench`` and shows them: `features_table`, the CSV records and the plot.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from attngrad.cli.args import calibrate, chosen_strategies, sizes
from attngrad.cli.table import (
    columns,
    destination,
    figure,
    verdict,
    write_csv,
    write_file,
)
from attngrad.core.contract import DTYPES
from attngrad.core.progress import Progress
from attngrad.tools import bench_features
from attngrad.tools.bench_features import FEATURES, TARGET_SEQ, TARGET_STRATEGY, FeatureRow
from attngrad.tools.machine import Machine

__all__ = ["features_plot", "features_records", "features_table", "run_features"]


def _target(x: float | None) -> str:
    return "-" if x is None else f"<= {x:g}"


def features_records(rows: Sequence[FeatureRow]) -> list[dict[str, object]]:
    """CSV records: the shape, feature, its baseline variant, strategy, min and median ms
    of both, the two ratios, the target ('' without one) and whether it was met."""
    shape = ("batch", "heads", "seq", "head_dim", "dtype", "device", "repeats")
    return [
        {
            **{name: getattr(r, name) for name in shape},
            "feature": r.feature,
            "baseline": r.baseline,
            "strategy": r.strategy,
            "min_ms": f"{r.low_s * 1e3:.6g}",
            "median_ms": f"{r.median_s * 1e3:.6g}",
            "baseline_min_ms": f"{r.base_low_s * 1e3:.6g}",
            "baseline_median_ms": f"{r.base_median_s * 1e3:.6g}",
            "ratio": f"{r.ratio:.6g}",
            "median_ratio": f"{r.median_ratio:.6g}",
            "target": "" if r.target is None else r.target,
            "met": "" if r.met is None else r.met,
        }
        for r in rows
    ]


def features_table(rows: Sequence[FeatureRow], machine: Machine) -> str:
    """The machine, what each feature is timed against and the targets, then one block
    per N: per strategy and feature both fastest times, the ratio and that of the
    medians, the target and a pass/FAIL mark."""
    if not rows:
        return machine.line() + "\n(no measurements)"
    first = rows[0]
    targets = ", ".join(f"{f.name} <= {f.target:g}" for f in FEATURES if f.target is not None)
    out = [
        machine.line(),
        f"B={first.batch} H={first.heads} d={first.head_dim} {first.dtype} on {first.device}: "
        "forward+backward (O, then dq, dk, dv) in one call; min and median of "
        f"{first.repeats} rounds (after 1 warm-up), every strategy and variant interleaved",
        "ratio = the feature's fastest round / its baseline's fastest round (below 1: "
        "faster); (median) = the same of the medians",
        *(f"  {f.name}: {f.about}" for f in FEATURES),
        f"targets (on {TARGET_STRATEGY}, set for N={TARGET_SEQ}; smaller N pay more fixed "
        f"cost per call): {targets}",
    ]
    header = ["feature", "strategy", "min ms", "baseline min ms", "ratio", "(median)", "target"]
    header.append("verdict")
    for n in dict.fromkeys(r.seq for r in rows):
        cells = [
            [r.feature, r.strategy, f"{r.low_s * 1e3:.2f}", f"{r.base_low_s * 1e3:.2f}",
             f"{r.ratio:.3f}", f"{r.median_ratio:.3f}", _target(r.target), verdict(r.met)]
            for r in rows
            if r.seq == n
        ]  # fmt: skip
        head, lines = columns(header, cells, left=2)
        out += ["", f"N={n}", head, *lines]
    return "\n".join(out)


def features_plot(
    rows: Sequence[FeatureRow], path: str | os.PathLike[str], machine: Machine
) -> None:
    """A PNG, one panel per N: each feature's ratio as bars, one per strategy, with
    ratio 1 dotted and each target as a dashed line over its feature."""
    if not rows:
        raise ValueError("features_plot needs at least one FeatureRow, got none")
    seqs = list(dict.fromkeys(r.seq for r in rows))
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    names = [f.name for f in FEATURES]
    width = 0.8 / len(strategies)
    with figure(path, 1.2 + 1.6 * len(names) * len(seqs), 4.4) as fig:
        axes = fig.subplots(1, len(seqs), squeeze=False, sharey=True)
        for ax, n in zip(axes[0], seqs, strict=True):
            for i, strategy in enumerate(strategies):
                ratio = {r.feature: r.ratio for r in rows if (r.seq, r.strategy) == (n, strategy)}
                x = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(names))]
                bars = ax.bar(x, [ratio[f] for f in names], width, label=strategy)
                ax.bar_label(bars, fmt="%.2f", fontsize="x-small")
            goals = [(j, f.target) for j, f in enumerate(FEATURES) if f.target is not None]
            ax.hlines([t for _, t in goals], [j - 0.45 for j, _ in goals],
                      [j + 0.45 for j, _ in goals], colors="red", linestyles="--",
                      label=f"target ({TARGET_STRATEGY})")  # fmt: skip
            ax.axhline(1.0, color="grey", linestyle=":")
            ax.set_xticks(range(len(names)), labels=names)
            ax.set_title(f"N={n}")
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][0].set_ylabel("feature time / baseline time (min)")
        axes[0][0].legend(fontsize="small")
        r = rows[0]
        fig.suptitle(
            f"attngrad bench --features: forward+backward, B={r.batch} H={r.heads} "
            f"d={r.head_dim} {r.dtype}\n{machine.line()}"
        )


def _features_refusal(
    args: argparse.Namespace, seqs: list[int], device: torch.device
) -> str | None:
    """Why ``bench --features`` cannot run as asked, or None."""
    if args.order == 2 or args.baseline:
        given = "--order 2" if args.order == 2 else "--baseline"
        return f"--features compares each strategy with itself, without SDPA; drop {given}"
    if "auto" in (args.strategy or ()):
        return "--features times named strategies: pick flash, explicit, recompute or triton"
    if "triton" in (args.strategy or ()) and device.type != "cuda":
        return "--features times triton on CUDA only: add --device cuda, or pick flash"
    try:
        bench_features.validate_seqs(seqs)
    except ValueError as e:
        return str(e)
    return None


def run_features(args: argparse.Namespace, seq_given: bool) -> int:
    """``bench --features``: each feature's forward+backward time over its baseline's;
    without ``--seq`` (``seq_given`` False) at `attngrad.tools.bench_features.TARGET_SEQ`.
    Returns the exit status."""
    device = args.device or torch.device("cpu")
    seqs = args.seq if seq_given else [TARGET_SEQ]
    refusal = _features_refusal(args, seqs, device)
    if refusal is not None:
        print(f"attngrad bench: error: {refusal}", file=sys.stderr)
        return 2
    asked = args.strategy or [TARGET_STRATEGY]
    strategies = chosen_strategies("bench", asked, device, interpreted=False)
    if strategies is None:
        return 2
    dtype = DTYPES[args.dtype]
    machine = calibrate(dtype, device, args.gemm_time)
    with Progress(bench_features.steps(seqs, args.repeats), "bench --features") as bar:
        rows = bench_features.run_features(
            seqs,
            strategies,
            **sizes(args, "batch", "heads", "head_dim"),
            dtype=dtype,
            repeats=args.repeats,
            device=device,
            step=bar.step,
        )
    print(features_table(rows, machine))
    csv_path = destination(args.csv, "results/bench_features.csv")
    write_file(csv_path, lambda path: write_csv(features_records(rows), path, machine))
    plot_path = destination(args.plot, "results/bench_features.png")
    write_file(plot_path, lambda path: features_plot(rows, path, machine))
    return 0
