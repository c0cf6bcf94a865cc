"""What the commands show and write: text tables (`check_table`, `bench_table`,
`features_table`, `ledger_table`, `explain_text`), CSV files (`write_csv` of the
``*_records``, with the `attngrad.tools.machine.Machine` columns on every row) and PNG plots
(``*_plot``).  The plots need matplotlib: without it they raise ModuleNotFoundError
whose message says how to install it (`PLOT_INSTALL`), and write nothing.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch

from attngrad.conformance.check import DERIVATIVE_TOLERANCE, GRADIENTS, CaseResult, format_error
from attngrad.learn.explain import PathReport, SavedTensor
from attngrad.tools.bench_features import FEATURES, TARGET_SEQ, TARGET_STRATEGY, FeatureRow
from attngrad.tools.bench_step import PASSES, BenchRow
from attngrad.tools.ledger import LedgerRow, SecondOrderRow
from attngrad.tools.machine import Machine

__all__ = [
    "PLOT_INSTALL",
    "bench_plot",
    "bench_records",
    "bench_table",
    "check_records",
    "check_summary",
    "check_table",
    "explain_text",
    "features_plot",
    "features_records",
    "features_table",
    "format_bytes",
    "ledger_plot",
    "ledger_records",
    "ledger_table",
    "second_order_records",
    "second_order_table",
    "write_csv",
]

PLOT_INSTALL = "matplotlib is not installed; install it with `pip install 'attngrad[plot]'`"

# ---------------------------------------------------------------- shared pieces


def format_bytes(n: int | None) -> str:
    """``840 B``, ``1.50 KiB``, ``536.00 MiB``; ``-`` for None.  Exact bytes while small,
    since the small cases are checked by eye."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:,.2f} {unit}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _pair(a: int, b: int, sep: str) -> str:
    """``8`` when equal, else ``8:2`` (GQA heads, d:dv) or ``64 x 128`` (Nq x Nk)."""
    return str(a) if a == b else f"{a}{sep}{b}"


def _columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: int
) -> tuple[str, list[str]]:
    """The header line and one line per row, every column as wide as its widest cell;
    the first ``left`` columns align left, the others right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{c:<{w}}" if i < left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return line(header), [line(r) for r in rows]


def write_csv(
    records: Sequence[Mapping[str, object]],
    path: str | os.PathLike[str],
    machine: Machine | None = None,
) -> None:
    """One line per record (columns from the first), then ``machine``'s columns."""
    if not records:
        raise ValueError(f"write_csv needs at least one record for {os.fspath(path)!r}, got none")
    extra = machine.columns() if machine is not None else {}
    clash = sorted(set(records[0]) & set(extra))
    if clash:
        raise ValueError(f"records have the machine's columns {clash}; rename them in the records")
    columns = [*records[0], *extra]
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({**r, **extra} for r in records)


@contextmanager
def _figure(path: str | os.PathLike[str], width: float, height: float) -> Iterator[Any]:
    """A matplotlib Figure to draw on, saved to ``path`` as PNG on exit."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ModuleNotFoundError(PLOT_INSTALL) from e
    fig = Figure(figsize=(width, height), layout="constrained")
    yield fig
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


# ------------------------------------------------------------------------- check

_RULE = (
    "max abs error vs float64; ratio: worst error / bound of the rule, <= 2x plain PyTorch "
    "+ a floor from the magnitudes (attngrad.conformance.check), at most 1 passes"
)
_DERIVATIVES = (
    "float64 only: d2 (double backward, a Hessian-vector product) and jvp (forward mode) "
    "against autograd through the float64 reference, max abs error / max(1, max |reference|), "
    f"at most {DERIVATIVE_TOLERANCE:g} passes; gradgrad: torch.autograd.gradgradcheck"
)
_VERDICT = {None: "-", True: "pass", False: "FAIL"}


def _failure(r: CaseResult) -> str:
    """What failed: the verifier's message, else each quantity over its bound."""
    if r.message:
        return r.message
    over = [
        f"{name}: error {format_error(e)} > bound {format_error(r.bounds[name])}"
        for name, e in r.errors.items()
        if name in r.bounds and not e <= r.bounds[name]
    ]
    if r.nan:
        over.append("NaN in the output or a gradient")
    if r.gradcheck_passed is False:
        over.append("gradcheck failed")
    for name, e in (("second_order", r.second_order_error), ("jvp", r.jvp_error)):
        if e is not None and not e <= DERIVATIVE_TOLERANCE:
            over.append(f"{name}: relative error {format_error(e)} > {DERIVATIVE_TOLERANCE:g}")
    if r.gradgradcheck_passed is False:
        over.append("gradgradcheck failed")
    return "; ".join(over)


def _worst_ratio(r: CaseResult) -> str:
    return f"{max(r.ratios.values(), default=0.0):.2f}" if r.ratios else "-"


def check_table(results: Sequence[CaseResult], failures_only: bool = False) -> str:
    """One row per result (only the failing ones with ``failures_only``): the max error
    of each quantity, the worst error/bound ratio of the rule over all of them (at most 1
    passes: how much of the allowance the case used) and the verdicts; on float64 cases
    also the relative errors of double backward (d2) and forward mode (jvp) and the
    gradgradcheck verdict; under a failing row, what failed and its bound."""
    shown = [r for r in results if not (failures_only and r.passed)]
    if not shown:
        return "no failing cases" if failures_only else "no cases"
    cells = [
        [
            r.strategy,
            r.case,
            *(format_error(r.errors.get(g)) for g in GRADIENTS),
            _worst_ratio(r),
            "NaN" if r.nan else ("pass" if r.rule_passed else "FAIL"),
            _VERDICT[r.gradcheck_passed],
            format_error(r.second_order_error),
            format_error(r.jvp_error),
            _VERDICT[r.gradgradcheck_passed],
        ]
        for r in shown
    ]
    header = ["strategy", "case", *GRADIENTS, "ratio", "rule", "gradcheck", "d2", "jvp"]
    header.append("gradgrad")
    head, lines = _columns(header, cells, left=2)
    out = [head]
    for r, line in zip(shown, lines, strict=True):
        out.append(line)
        if not r.passed:
            out.append(f"    {_failure(r)}")
    return "\n".join(out)


def check_summary(results: Sequence[CaseResult]) -> str:
    """Passed and failed counts per strategy, then in all."""
    lines = []
    for strategy in dict.fromkeys(r.strategy for r in results):
        mine = [r for r in results if r.strategy == strategy]
        failed = sum(not r.passed for r in mine)
        lines.append(f"{strategy}: {len(mine) - failed} passed, {failed} failed")
    failed = sum(not r.passed for r in results)
    lines.append(f"{len(results) - failed} passed, {failed} failed ({_RULE})")
    if any(r.second_order_error is not None for r in results):
        lines.append(f"({_DERIVATIVES})")
    return "\n".join(lines)


def check_records(results: Sequence[CaseResult]) -> list[dict[str, object]]:
    """CSV records: strategy, case, dtype, the verdicts, the worst ratio, ``error_<x>`` and
    ``ratio_<x>`` per quantity of `attngrad.conformance.check.GRADIENTS` (empty where the case has
    none), the higher-derivative errors and the message."""
    return [
        {
            "strategy": r.strategy,
            "case": r.case,
            "dtype": r.dtype,
            "passed": r.passed,
            "rule_passed": r.rule_passed,
            "ratio": max(r.ratios.values(), default=""),
            **{f"error_{g}": r.errors.get(g, "") for g in GRADIENTS},
            **{f"ratio_{g}": r.ratios.get(g, "") for g in GRADIENTS},
            "gradcheck_passed": r.gradcheck_passed,
            "second_order_error": r.second_order_error,
            "jvp_error": r.jvp_error,
            "gradgradcheck_passed": r.gradgradcheck_passed,
            "message": r.message,
        }
        for r in results
    ]


# ------------------------------------------------------------------------- bench


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
    cells = [
        [
            r.pass_,
            r.contender,
            f"{r.time_s * 1e3:.2f}",
            f"{r.low_s * 1e3:.2f}–{r.high_s * 1e3:.2f}",
            f"{r.gflops:.1f}",
            f"{r.gemm_fraction:.1%}" + ("*" if r.gemm_fraction > 1 else " "),
            *(f"{r.ratios[b]:.2f}" for b in baselines),
        ]
        for r in rows
    ]
    header = ["pass", "contender", "median ms", "min–max ms", "GFLOP/s", "of GEMM "]
    head, lines = _columns([*header, *(f"vs {b}" for b in baselines)], cells, left=2)
    out = [
        machine.line(),
        f"B={first.batch} H={first.heads} d={first.head_dim} {first.dtype}, median and "
        f"min–max of {first.repeats} rounds (after 1 warm-up)",
        "vs <baseline> = median time / baseline median time (below 1: faster)",
    ]
    previous: BenchRow | None = None
    for r, line in zip(rows, lines, strict=True):
        if previous is None or (r.seq_q, r.causal) != (previous.seq_q, previous.causal):
            title = f"N={r.seq_q} causal={_yes(r.causal)} (strategy auto picks {r.auto})"
            out += ["", title, head]
        elif r.pass_ != previous.pass_:
            out.append("")
        out.append(line)
        previous = r
    if any(r.gemm_fraction > 1 for r in rows):
        out += ["", _above_gemm(machine)]
    return "\n".join(out)


def bench_plot(rows: Sequence[BenchRow], path: str | os.PathLike[str], machine: Machine) -> None:
    """A PNG: GFLOP/s against N, one panel per (causal, pass), the GEMM rate dotted."""
    if not rows:
        raise ValueError("bench_plot needs at least one BenchRow, got none")
    causal_modes = sorted({r.causal for r in rows})
    contenders = list(dict.fromkeys(r.contender for r in rows))
    seqs = sorted({r.seq_q for r in rows})
    with _figure(path, 4.5 * len(PASSES), 3.5 * len(causal_modes) + 0.5) as fig:
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
                    style = "--" if name.startswith("sdpa-") else "-"
                    ax.plot([n for n, _ in pts], [g for _, g in pts], style, marker="o", label=name)
                ax.axhline(machine.gemm_gflops, color="grey", linestyle=":", label="GEMM rate")
                ax.set_xscale("log", base=2)
                ax.set_xticks(seqs, labels=[str(n) for n in seqs])
                ax.minorticks_off()
                ax.set_title(f"{pass_}, causal={_yes(causal)}")
                ax.set_xlabel("N")
                if j == 0:
                    ax.set_ylabel("GFLOP/s")
        axes[0][0].legend(fontsize="small")
        r = rows[0]
        fig.suptitle(
            f"attngrad bench: B={r.batch} H={r.heads} d={r.head_dim} {r.dtype}\n{machine.line()}"
        )


# -------------------------------------------------------------- bench --features


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
             f"{r.ratio:.3f}", f"{r.median_ratio:.3f}", _target(r.target), _VERDICT[r.met]]
            for r in rows
            if r.seq == n
        ]  # fmt: skip
        head, lines = _columns(header, cells, left=2)
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
    with _figure(path, 1.2 + 1.6 * len(names) * len(seqs), 4.4) as fig:
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


# ------------------------------------------------------------------------ ledger


def ledger_records(rows: Sequence[LedgerRow]) -> list[dict[str, object]]:
    """CSV records: every `LedgerRow` field (bytes) and ``match``."""
    return [{**asdict(r), "match": r.match} for r in rows]


def ledger_table(rows: Sequence[LedgerRow], machine: Machine) -> str:
    """The machine, then one row per path and layout."""
    cells = [
        [
            r.path,
            str(r.batch),
            _pair(r.heads_q, r.heads_kv, ":"),
            _pair(r.seq_q, r.seq_k, " x "),
            _pair(r.head_dim, r.value_dim, ":"),
            r.dtype,
            _yes(r.causal),
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
    head, lines = _columns(header, cells, left=1)
    return "\n".join([machine.line(), head, "-" * len(head), *lines])


def _layout_cells(r: LedgerRow | SecondOrderRow) -> list[str]:
    """B, H, Nq x Nk, d, dtype, causal of a ledger row."""
    return [
        str(r.batch),
        _pair(r.heads_q, r.heads_kv, ":"),
        _pair(r.seq_q, r.seq_k, " x "),
        _pair(r.head_dim, r.value_dim, ":"),
        r.dtype,
        _yes(r.causal),
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
            _yes(r.supported),
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
    head, lines = _columns(header, cells, left=1)
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
    with _figure(path, 6.5 * len(panels), 5.0) as fig:
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
            f"attngrad ledger: B={r.batch} H={_pair(r.heads_q, r.heads_kv, ':')} "
            f"d={r.head_dim} {r.dtype}   (hollow circles: predicted by the saved-bytes "
            f"formulas)\n{machine.line()}"
        )


# ----------------------------------------------------------------------- explain


def _per_head(t: SavedTensor, nq: int, nk: int) -> str:
    """The tensor's size per (batch, head) in symbols: N×N for P, N×2 for (m, log l), N×d for O."""
    n_q, n_k = ("N", "N") if nq == nk else ("Nq", "Nk")
    base = t.role.split("*")[0].split(" ")[0]
    if base in ("P", "S"):
        return f"{n_q}×{n_k} per head"
    if base == "stats":
        return f"{n_q}×2 per head: m, log l"
    if base in ("O", "q"):
        return f"{n_q}×d per head"
    if base in ("k", "v"):
        return f"{n_k}×d per head"
    if base == "scalar":
        return "one number"
    return "shape " + "×".join(map(str, t.shape))


def _kept_line(r: PathReport) -> str:
    _, _, nq, nk, _ = r.shape
    parts = [
        f"{t.role} ({_per_head(t, nq, nk)}, {_dtype(t.dtype)}) {format_bytes(t.nbytes)}"
        for t in r.kept
    ]
    return " + ".join(parts) if parts else "nothing"


def _explain_path(r: PathReport) -> list[str]:
    lines = [f"== {r.path}: {r.description} =="]
    width = max((len(n.name) + 2 * n.depth for n in r.nodes), default=0) + 8
    for n in r.nodes:
        pad = "  " * (n.depth + 1)
        head = f"{pad}#{n.step} {n.name}" + (f" -> {n.leaf}.grad" if n.leaf else "")
        nxt = ", ".join(f"#{s}" for s in n.next_steps)
        lines.append((f"{head:<{width}}" + (f" then {nxt}" if nxt else "")).rstrip())
        for t in n.saved:
            kind = "input" if t.is_input else "computed"
            shape = "[" + ", ".join(map(str, t.shape)) + "]"
            note = (
                ""
                if t.hooked
                else ("  (saved by forward)" if t.forward else "  (not seen by hooks)")
            )
            lines.append(
                f"{pad}    saved {t.slot:<17} {shape:<15} {_dtype(t.dtype):<9}"
                f" {format_bytes(t.nbytes):>10}  {t.role} ({kind}){note}"
            )
        if n.none_slots:
            lines.append(f"{pad}    saved {n.none_slots} × None (optional inputs not given)")
    check = "agree" if r.graph_bytes == r.hooked_bytes else "differ"
    by = "" if r.order == 1 else " by the create_graph backward"
    lines.append(
        f"  total: {r.graph_count} saved tensors{by}, {format_bytes(r.graph_bytes)} found on "
        f"the graph; saved_tensors_hooks packed {r.hooked_count}, "
        f"{format_bytes(r.hooked_bytes)} ({check})"
    )
    forward = [t for t in r.saved if t.forward]
    if forward:
        lines.append(
            f"  and {len(forward)} saved by forward, {format_bytes(sum(t.nbytes for t in forward))}: "
            "the gradients' graph reaches forward's nodes, which keep them"
        )
    if r.unhooked:
        extra = format_bytes(sum(t.nbytes for t in r.unhooked))
        lines.append(
            f"  the {extra} difference: {len(r.unhooked)} 0-dim tensor(s) wrapping a "
            "Python scalar, which PyTorch saves without calling the hooks"
            if all(not t.shape for t in r.unhooked)
            else f"  the {extra} difference: tensors the hooks did not see"
        )
    lines.append(
        f"  inputs saved by reference (no new memory): {', '.join(r.inputs_saved) or 'none'}"
    )
    until = "backward" if r.order == 1 else "the second backward"
    lines.append(
        f"  kept alive for {until} besides the inputs: {format_bytes(r.kept_bytes)} = "
        f"{_kept_line(r)}"
    )
    return lines


def _explain_summary(reports: Sequence[PathReport]) -> list[str]:
    first = reports[0]
    b, h, nq, nk, d = first.shape
    base = next((r for r in reports if r.path == "pytorch-math"), first)
    name_w = max(len(r.path) for r in reports)
    between = (
        "between forward and backward besides q, k, v"
        if first.order == 1
        else "from the create_graph backward to the second backward besides q, k, v, dO"
    )
    lines = [
        "== summary: same formulas, different paths ==",
        "  every path differentiates the same forward with the same formulas:",
        "    dV = P^T dO    dP = dO V^T    dS = P∘(dP − rowsum(P∘dP))    dQ = s·dS K    dK = s·dS^T Q",
        f"  what each path keeps alive {between} "
        f"(B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, {_dtype(first.dtype)}):",
    ]
    for r in reports:
        ratio = r.kept_bytes / base.kept_bytes if base.kept_bytes else math.nan
        lines.append(
            f"    {r.path:<{name_w}}  keeps {_kept_line(r)}"
            f"  = {format_bytes(r.kept_bytes)}, {ratio:.2f}× {base.path}"
        )
    recompute_like = [r.path for r in reports if r.path in ("recompute", "flash")]
    if recompute_like and first.order == 1:
        lines.append(
            f"  {' and '.join(recompute_like)} pay for the smaller ledger in backward: they "
            "recompute S = s·q k^T and P = exp((S − m) − log l) instead of reading a saved P"
        )
    # the same per-head ledger at a long-context shape, from the same element sizes
    n, dd = 4096, 64
    elem = first.dtype.itemsize
    stat_elem = 8 if first.dtype == torch.float64 else 4
    lines.append(
        f"  P grows as N², O and (m, log l) as N: at N={n}, d={dd} per head, "
        f"P = {format_bytes(n * n * elem)}, O = {format_bytes(n * dd * elem)}, "
        f"(m, log l) = {format_bytes(2 * n * stat_elem)}"
    )
    return lines


def explain_text(reports: Sequence[PathReport]) -> str:
    """Per path its nodes in the order backward ran them (indented by depth from O) with
    their saved tensors and the totals, then a summary comparing what each path keeps."""
    if not reports:
        return ""
    b, h, nq, nk, d = reports[0].shape
    graph = (
        "Each path's grad_fn graph from O, #n = the step at which the autograd engine ran "
        "the node in backward (indent = distance from O); under each node the tensors it "
        "saved for backward."
        if reports[0].order == 1
        else "Each path's double-backward graph: the grad_fn graph of dq, dk, dv from "
        "grad(O, (q, k, v), dO = ones, create_graph=True), #n = the step at which the "
        "autograd engine ran the node in the second backward (indent = distance from "
        "dq, dk, dv); under each node the tensors that backward saved for the second."
    )
    lines = [
        f"attngrad explain: q [{b}, {h}, {nq}, {d}], k, v [{b}, {h}, {nk}, {d}], "
        f"{_dtype(reports[0].dtype)}" + ("" if reports[0].order == 1 else ", order 2"),
        graph,
        "",
    ]
    for r in reports:
        lines += [*_explain_path(r), ""]
    lines += _explain_summary(reports)
    return "\n".join(lines)
