"""The ``attngrad`` command (also ``python -m attngrad``).

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
attngrad --version

The commands compute rows (`attngrad.conformance.check`, `attngrad.tools.ledger`, `attngrad.learn.explain`,
`attngrad.tools.bench_step`) and hand them to `attngrad.cli.report`; this module parses, refuses what
cannot run here, and says where each file went.  ``--csv ''`` and ``--plot ''`` skip
that file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

import attngrad
from attngrad.cli import report
from attngrad.cli.args import (
    chosen_strategies,
    measure_device,
    positive_float,
    positive_int,
    write_json,
)
from attngrad.cli.kernels import add_kernels
from attngrad.cli.learn import add_exercise, add_grade
from attngrad.cli.verify import add_verify
from attngrad.conformance.check import Case, CaseResult, default_cases, run_case
from attngrad.core.contract import DTYPES, Shapes
from attngrad.core.progress import Progress
from attngrad.learn.explain import explain
from attngrad.strategies import STRATEGIES
from attngrad.tools import bench_features as feature_bench
from attngrad.tools import bench_hvp as hvp
from attngrad.tools import bench_step as bench
from attngrad.tools import ledger
from attngrad.tools.machine import Machine, probe

__all__ = ["main"]

_CAUSAL_MODES = {"both": [False, True], "no": [False], "yes": [True]}
# bench's --seq default; `_bench_features` tells it from a --seq given by identity
_BENCH_SEQS = [1024, 2048, 4096]

# ------------------------------------------------------------------- shared steps


def _sizes(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The size flags ``names`` as keyword arguments (``--head-dim`` is ``head_dim``)."""
    return {name: getattr(args, name) for name in names}


def _destination(given: str | None, default: str | None) -> str | None:
    """Where to write a file: ``default`` when the flag is absent, nowhere for ``''``."""
    return default if given is None else (given or None)


def _write(path: str | None, write: Callable[[str], None]) -> None:
    """``write(path)`` and say so; a plot without matplotlib says how to install it and
    the command goes on."""
    if not path:
        return
    try:
        write(path)
    except ModuleNotFoundError as e:
        print(f"skipped the plot {path}: {e}", file=sys.stderr)
        return
    print(f"wrote {path}")


def _machine(dtype: torch.dtype, device: torch.device, budget: float) -> Machine:
    """`attngrad.tools.machine.probe`, each calibration step shown on stderr."""
    name = str(dtype).removeprefix("torch.")
    print(f"calibrating the {name} matmul rate ({budget:g} s per GEMM)...", file=sys.stderr)

    def note(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    return probe(dtype, device, budget, note=note)


# -------------------------------------------------------------------------- check


def _check(args: argparse.Namespace) -> int:
    strategies = chosen_strategies("check", args.strategy, torch.device("cpu"), interpreted=True)
    if strategies is None:
        return 2
    cases = default_cases()
    results: list[CaseResult] = []
    torch.manual_seed(args.seed)
    with Progress(len(strategies) * len(cases), "check") as bar:
        for strategy in strategies:
            for case in cases:
                results.append(run_case(strategy, case, args.seed, gradcheck=args.gradcheck))
                bar.step(f"{strategy} {case.id}")
    # with --json -, stdout carries the JSON alone
    out = sys.stderr if args.json == "-" else sys.stdout
    print(report.check_table(results, failures_only=args.failures), file=out)
    print(report.check_summary(results), file=out)
    failed = any(not r.passed for r in results)
    if args.json:
        payload = {
            "torch": torch.__version__,
            "attngrad": attngrad.__version__,
            "strategies": strategies,
            "passed": not failed,
            "results": [r.as_dict() for r in results],
        }
        write_json(payload, args.json, out)
    if args.csv:
        report.write_csv(report.check_records(results), args.csv)
        print(f"wrote {args.csv}", file=out)
    return 1 if failed else 0


def _add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="conformance grid of every strategy against a float64 reference",
        description=(
            "Run every strategy over a grid of dtypes, masks and layouts and compare the "
            "output and every gradient with a float64 reference, element by element: at most "
            "2x the error of plain PyTorch in the same dtype plus a floor derived from the "
            "magnitudes that produce each quantity (attngrad.conformance.check); on float64 cases "
            "gradcheck, double backward and forward mode against autograd through the "
            "reference (relative error at most 1e-9) and gradgradcheck.  Exit 1 on a failed "
            "case, 2 when a strategy asked for cannot run here."
        ),
    )
    _add_strategy(p, STRATEGIES, "check only this strategy (repeatable)")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH; '-' writes them to stdout (the table then goes to stderr)",
    )
    p.add_argument(
        "--failures",
        action="store_true",
        help="list only the failing cases (the per-strategy counts still print)",
    )
    p.add_argument(
        "--csv", metavar="PATH", help="also write one row per strategy and case as CSV to PATH"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument(
        "--no-gradcheck",
        dest="gradcheck",
        action="store_false",
        help="skip gradcheck and gradgradcheck (faster)",
    )
    p.set_defaults(run=_check)


# ------------------------------------------------------------------------- ledger


def _ledger_layout(args: argparse.Namespace, seq_q: int, seq_k: int) -> Case:
    heads_kv = args.heads_kv or args.heads
    shapes = Shapes(
        (args.batch,), args.heads, heads_kv, seq_q, seq_k, args.head_dim,
        args.value_dim or args.head_dim,
    )  # fmt: skip
    return Case(shapes, DTYPES[args.dtype], "causal" if args.causal else "none")


def _ledger(args: argparse.Namespace) -> int:
    device: torch.device = args.device
    strategies = chosen_strategies("ledger", args.strategy, device, interpreted=False)
    if strategies is None:
        return 2
    paths = strategies if args.strategy else [*strategies, *ledger.BASELINES]
    sizes = [(n, n) for n in args.sweep] if args.sweep else [(args.seq_q, args.seq_k or args.seq_q)]
    layouts = [_ledger_layout(args, seq_q, seq_k) for seq_q, seq_k in sizes]
    machine = _machine(DTYPES[args.dtype], device, args.gemm_time)
    if args.order == 2:
        return _ledger_second_order(args, paths, layouts, machine)
    try:
        with Progress(len(paths) * len(layouts), "ledger") as bar:
            rows, notes = ledger.run_ledger(
                paths, layouts, str(device), peak=not args.no_peak, step=bar.step
            )
    except (ValueError, TypeError) as e:
        print(f"attngrad ledger: error: {e}", file=sys.stderr)
        return 2
    for line in notes:
        print(line, file=sys.stderr)
    print(report.ledger_table(rows, machine))
    sweep_default = "results/ledger.{}" if args.sweep else None
    if rows:  # none when every path asked for is a baseline that rejected the case
        csv_path = _destination(args.csv, sweep_default and sweep_default.format("csv"))
        _write(csv_path, lambda path: report.write_csv(report.ledger_records(rows), path, machine))
        plot_path = _destination(args.plot, sweep_default and sweep_default.format("png"))
        _write(plot_path, lambda path: report.ledger_plot(rows, path, machine))
    mismatched = [r for r in rows if r.match is False]
    for r in mismatched:
        print(
            f"MISMATCH {r.path} N={r.seq_q}: predicted {r.predicted_saved} measured {r.measured_saved}"
        )
    return 1 if mismatched else 0


def _ledger_second_order(
    args: argparse.Namespace, paths: Sequence[str], layouts: Sequence[Case], machine: Machine
) -> int:
    """``ledger --order 2``: the double-backward table, and its CSV (no plot)."""
    try:
        with Progress(len(paths) * len(layouts), "ledger") as bar:
            rows, notes = ledger.run_second_order_ledger(
                paths, layouts, str(args.device), peak=not args.no_peak, step=bar.step
            )
    except (ValueError, TypeError) as e:
        print(f"attngrad ledger: error: {e}", file=sys.stderr)
        return 2
    for line in notes:
        print(line, file=sys.stderr)
    print(report.second_order_table(rows, machine))
    sweep_default = "results/ledger_order2.csv" if args.sweep else None
    csv_path = _destination(args.csv, sweep_default)
    if rows:
        records = report.second_order_records(rows)
        _write(csv_path, lambda path: report.write_csv(records, path, machine))
    if args.plot:
        print(f"skipped the plot {args.plot}: --order 2 writes no plot", file=sys.stderr)
    return 0


def _add_ledger(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _add_sizes(p, heads=8, head_dim=64)
    p.add_argument("--heads-kv", type=positive_int, help="key/value heads Hkv for GQA (default H)")
    _add_size(p, "--seq-q", 1024, "query length Nq (default 1024)")
    p.add_argument("--seq-k", type=positive_int, help="key length Nk (default Nq)")
    p.add_argument("--value-dim", type=positive_int, help="value head dim dv (default d)")
    p.add_argument("--causal", action="store_true", help="is_causal=True")
    p.add_argument(
        "--device",
        type=measure_device,
        default=torch.device("cpu"),
        help="cpu, or cuda with a CUDA GPU (default cpu)",
    )
    _add_strategy(
        p,
        (*STRATEGIES, *ledger.BASELINES),
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
    _add_machine_and_files(p, "results/ledger", "with --sweep: ")
    p.set_defaults(run=_ledger)


# ------------------------------------------------------------------------ explain


def _explain(args: argparse.Namespace) -> int:
    strategies = chosen_strategies("explain", args.strategy, torch.device("cpu"), interpreted=True)
    if strategies is None:
        return 2
    sizes = _sizes(args, "batch", "heads", "seq_q", "seq_k", "head_dim")
    reports = explain(
        **sizes,
        dtype=DTYPES[args.dtype],
        is_causal=args.causal,
        strategies=strategies,
        order=args.order,
    )
    print(report.explain_text(reports))
    return 0


def _add_explain(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="show each path's grad_fn graph and the tensors it saves for backward",
        description=(
            "For a small input, the grad_fn graph of PyTorch's plain math, SDPA's MATH "
            "backend and each strategy, numbered in the order the autograd engine runs "
            "backward, with the tensors each node saved, and what each path keeps alive."
        ),
    )
    _add_sizes(p, heads=2, head_dim=4)
    _add_size(p, "--seq-q", 8, "Nq, query length (default 8)")
    _add_size(p, "--seq-k", 8, "Nk, key length (default 8)")
    p.add_argument("--causal", action="store_true", help="causal mask (top-left aligned)")
    p.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the graph from O (default); 2: the double-backward graph, from dq, dk, dv "
        "built with create_graph=True",
    )
    _add_strategy(
        p,
        STRATEGIES,
        "explain only this strategy (repeatable; default all); the baselines always run",
    )
    p.set_defaults(run=_explain)


# -------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    if args.features:
        return _bench_features(args)
    if args.device is not None:
        print("attngrad bench: error: --device goes with --features only", file=sys.stderr)
        return 2
    cpu = torch.device("cpu")
    strategies = chosen_strategies("bench", args.strategy, cpu, interpreted=False)
    if strategies is None:
        return 2
    if args.order == 2:
        return _bench_order2(args, strategies)
    baselines = list(dict.fromkeys(args.baseline or bench.BASELINES))
    causal_modes = _CAUSAL_MODES[args.causal]
    dtype = DTYPES[args.dtype]
    machine = _machine(dtype, cpu, args.gemm_time)
    with Progress(bench.steps(args.seq, causal_modes, args.repeats), "bench") as bar:
        rows = bench.run_bench(
            args.seq,
            causal_modes,
            strategies,
            baselines,
            **_sizes(args, "batch", "heads", "head_dim"),
            dtype=dtype,
            repeats=args.repeats,
            gemm_gflops=machine.gemm_gflops,
            step=bar.step,
        )
    print(report.bench_table(rows, machine))
    if "flash" in strategies and "explicit" in strategies:
        print()
        for causal in causal_modes:
            n = bench.crossover(rows, causal=causal)
            where = f"from N={n}" if n is not None else "at no measured N"
            print(
                f"forward+backward, causal={'yes' if causal else 'no'}: "
                f"flash is faster than explicit {where}"
            )
    csv_path = _destination(args.csv, "results/bench.csv")
    _write(csv_path, lambda path: report.write_csv(report.bench_records(rows), path, machine))
    plot_path = _destination(args.plot, "results/bench.png")
    _write(plot_path, lambda path: report.bench_plot(rows, path, machine))
    return 0


def _bench_order2(args: argparse.Namespace, strategies: list[str]) -> int:
    """``bench --order 2``: the HVP and jvp of each strategy against SDPA's MATH."""
    wrong = [b for b in args.baseline or () if b != "math"]
    if wrong:
        print(
            f"attngrad bench: error: --order 2 compares with SDPA's math backend only (the one "
            f"with a double backward on CPU), got --baseline {wrong[0]}; drop it",
            file=sys.stderr,
        )
        return 2
    contenders = [*strategies, hvp.BASELINE]
    causal_modes = _CAUSAL_MODES[args.causal]
    dtype = DTYPES[args.dtype]
    machine = _machine(dtype, torch.device("cpu"), args.gemm_time)
    notes: list[str] = []
    with Progress(hvp.steps(args.seq, causal_modes, args.repeats), "bench --order 2") as bar:
        rows = hvp.run_order2(
            args.seq,
            causal_modes,
            contenders,
            **_sizes(args, "batch", "heads", "head_dim"),
            dtype=dtype,
            repeats=args.repeats,
            loss=args.loss,
            peak=not args.no_peak,
            step=bar.step,
            note=notes.append,
        )
    for line in notes:
        print(line, file=sys.stderr)
    print(hvp.order2_table(rows, machine))
    csv_path = _destination(args.csv, "results/bench_hvp.csv")
    _write(csv_path, lambda path: report.write_csv(hvp.order2_records(rows), path, machine))
    plot_path = _destination(args.plot, "results/bench_hvp.png")
    _write(plot_path, lambda path: hvp.order2_plot(rows, path, machine))
    return 0


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
        feature_bench.validate_seqs(seqs)
    except ValueError as e:
        return str(e)
    return None


def _bench_features(args: argparse.Namespace) -> int:
    """``bench --features``: each feature's forward+backward time over its baseline's."""
    device = args.device or torch.device("cpu")
    seqs = [feature_bench.TARGET_SEQ] if args.seq is _BENCH_SEQS else args.seq
    refusal = _features_refusal(args, seqs, device)
    if refusal is not None:
        print(f"attngrad bench: error: {refusal}", file=sys.stderr)
        return 2
    asked = args.strategy or [feature_bench.TARGET_STRATEGY]
    strategies = chosen_strategies("bench", asked, device, interpreted=False)
    if strategies is None:
        return 2
    dtype = DTYPES[args.dtype]
    machine = _machine(dtype, device, args.gemm_time)
    with Progress(feature_bench.steps(seqs, args.repeats), "bench --features") as bar:
        rows = feature_bench.run_features(
            seqs,
            strategies,
            **_sizes(args, "batch", "heads", "head_dim"),
            dtype=dtype,
            repeats=args.repeats,
            device=device,
            step=bar.step,
        )
    print(report.features_table(rows, machine))
    csv_path = _destination(args.csv, "results/bench_features.csv")
    _write(csv_path, lambda path: report.write_csv(report.features_records(rows), path, machine))
    plot_path = _destination(args.plot, "results/bench_features.png")
    _write(plot_path, lambda path: report.features_plot(rows, path, machine))
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _add_sizes(p, heads=8, head_dim=64)
    p.add_argument(
        "--seq",
        type=positive_int,
        nargs="+",
        default=_BENCH_SEQS,
        metavar="N",
        help="sequence lengths, Nq = Nk = N (default 1024 2048 4096; with --features 4096)",
    )
    p.add_argument(
        "--causal",
        choices=tuple(_CAUSAL_MODES),
        default="both",
        help="is_causal runs (default both)",
    )
    _add_strategy(
        p,
        (*STRATEGIES, "auto"),
        "time only this strategy (repeatable; default every one that runs on CPU, with "
        "--features flash)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        choices=tuple(bench.BASELINES),
        help="SDPA backend to compare with (repeatable; default math and flash)",
    )
    _add_size(p, "--repeats", 5, "timed rounds, after 1 warm-up (default 5)")
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
        choices=hvp.LOSSES,
        default="square",
        help="with --order 2, the loss whose HVP is taken: square = sum(O**2)/2 (default), "
        "dot = <O, dO> for a fixed random dO",
    )
    p.add_argument(
        "--no-peak", action="store_true", help="with --order 2, skip the HVP peak-memory runs"
    )
    fb = feature_bench
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
    _add_machine_and_files(p, "results/bench", "")
    p.set_defaults(run=_bench)


# ---------------------------------------------------------- flags shared by commands


def _add_size(p: argparse.ArgumentParser, flag: str, default: int, help: str) -> None:
    p.add_argument(flag, type=positive_int, default=default, help=help)


def _add_strategy(p: argparse.ArgumentParser, choices: Collection[str], help: str) -> None:
    p.add_argument("--strategy", action="append", choices=choices, help=help)


def _add_sizes(p: argparse.ArgumentParser, heads: int, head_dim: int) -> None:
    """``--batch``, ``--heads``, ``--head-dim`` and ``--dtype``, alike on every command."""
    _add_size(p, "--batch", 1, "batch B (default 1)")
    _add_size(p, "--heads", heads, f"query heads H (default {heads})")
    _add_size(p, "--head-dim", head_dim, f"head dim d (default {head_dim})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default float32)")


def _add_machine_and_files(p: argparse.ArgumentParser, stem: str, when: str) -> None:
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


# --------------------------------------------------------------------------- main


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
        _add_check,
        _add_ledger,
        _add_explain,
        _add_bench,
        add_verify,
        add_exercise,
        add_grade,
        add_kernels,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.run(args))
