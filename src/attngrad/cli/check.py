"""``attngrad check [--strategy NAME ...] [--json PATH|-] [--csv PATH] [--failures] [--seed N]
[--no-gradcheck]``.

The conformance grid (`attngrad.verify.check`): every strategy over dtypes, masks
and layouts, then FlexAttention's score functions and BlockMasks (`flex_cases`),
each quantity judged against float64.  This module runs it and shows it: the table
(`check_table`), the per-strategy counts (`check_summary`) and the CSV records
(`check_records`).  A case a strategy declines (a call its kernels cannot run:
a score function on fused or triton) is shown refused, with the strategy's
reason, and fails nothing.  Exit 1 on a failed case, 2 on a strategy that cannot
run here.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import torch

import attngrad
from attngrad.cli.args import add_strategy, chosen_strategies
from attngrad.cli.table import columns, verdict, write_csv, write_json
from attngrad.core.progress import Progress
from attngrad.strategies import STRATEGIES
from attngrad.verify.cases import Case, default_cases, flex_cases
from attngrad.verify.check import CaseResult, expect_case, format_error, run_case
from attngrad.verify.derivatives import DERIVATIVE_TOLERANCE
from attngrad.verify.rule import GRADIENTS

__all__ = ["add_check", "check_records", "check_summary", "check_table", "estimate", "run_check"]

_RULE = (
    "max abs error vs float64 on the inputs as the strategy received them; ratio: worst "
    "error / bound of the rule, max(2x plain PyTorch, a fused kernel's 16-bit products) + a "
    "floor derived from the computation (lse: the floor alone; attngrad.verify.rule), at most "
    "1 passes"
)
_DERIVATIVES = (
    "float64 only: d2 (double backward, a Hessian-vector product) and jvp (forward mode) "
    "against autograd through the float64 reference, max abs error / max(1, max |reference|), "
    f"at most {DERIVATIVE_TOLERANCE:g} passes; gradgrad: torch.autograd.gradgradcheck"
)


def _failure(r: CaseResult) -> str:
    """What failed: the verifier's message, else each quantity over its bound."""
    if r.refused is not None:
        return f"refused: {r.refused}"
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
    shown = [r for r in results if not (failures_only and not r.failed)]
    if not shown:
        return "no failing cases" if failures_only else "no cases"
    cells = [
        [
            r.strategy,
            r.case,
            *(format_error(r.errors.get(g)) for g in GRADIENTS),
            _worst_ratio(r),
            _rule_verdict(r),
            verdict(r.gradcheck_passed),
            format_error(r.second_order_error),
            format_error(r.jvp_error),
            verdict(r.gradgradcheck_passed),
        ]
        for r in shown
    ]
    header = ["strategy", "case", *GRADIENTS, "ratio", "rule", "gradcheck", "d2", "jvp"]
    header.append("gradgrad")
    head, lines = columns(header, cells, left=2)
    out = [head]
    for r, line in zip(shown, lines, strict=True):
        out.append(line)
        if r.failed:
            out.append(f"    {_failure(r)}")
    return "\n".join(out)


def _rule_verdict(r: CaseResult) -> str:
    if r.refused is not None:
        return "refused"
    return "NaN" if r.nan else ("pass" if r.rule_passed else "FAIL")


def check_summary(results: Sequence[CaseResult]) -> str:
    """Passed and failed counts per strategy, then in all; the refused ones with their
    reasons, once each."""
    lines = []
    for strategy in dict.fromkeys(r.strategy for r in results):
        mine = [r for r in results if r.strategy == strategy]
        lines.append(f"{strategy}: {_counts(mine)}")
        reasons = dict.fromkeys(r.refused for r in mine if r.refused is not None)
        lines += [f"  refused: {reason}" for reason in reasons]
    lines.append(f"{_counts(results)} ({_RULE})")
    if any(r.second_order_error is not None for r in results):
        lines.append(f"({_DERIVATIVES})")
    return "\n".join(lines)


def _counts(results: Sequence[CaseResult]) -> str:
    """ "N passed, M failed" (", K refused" where some were)."""
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results)
    refused = len(results) - passed - failed
    return f"{passed} passed, {failed} failed" + (f", {refused} refused" if refused else "")


def check_records(results: Sequence[CaseResult]) -> list[dict[str, object]]:
    """CSV records: strategy, case, dtype, the verdicts, the worst ratio, ``error_<x>`` and
    ``ratio_<x>`` per quantity of `attngrad.verify.rule.GRADIENTS` (empty where the case has
    none), the higher-derivative errors, the refusal (empty where it ran) and the message;
    ``passed`` is empty on a refused case."""
    return [
        {
            "strategy": r.strategy,
            "case": r.case,
            "dtype": r.dtype,
            "passed": "" if r.refused is not None else r.passed,
            "rule_passed": r.rule_passed,
            "ratio": max(r.ratios.values(), default=""),
            **{f"error_{g}": r.errors.get(g, "") for g in GRADIENTS},
            **{f"ratio_{g}": r.ratios.get(g, "") for g in GRADIENTS},
            "gradcheck_passed": r.gradcheck_passed,
            "second_order_error": r.second_order_error,
            "jvp_error": r.jvp_error,
            "gradgradcheck_passed": r.gradgradcheck_passed,
            "refused": r.refused or "",
            "message": r.message,
        }
        for r in results
    ]


# Seconds a case takes, (without, with) gradcheck, per strategy: measured over the whole grid
# on a 2-core AMD EPYC shared with other work (a flex case counts `_FLEX_WEIGHT` plain ones:
# a score function traced, a BlockMask walked), float64 references included.  What
# `estimate` multiplies, for the line the command prints before its first case.
_CASE_SECONDS = {
    "explicit": (0.45, 0.6),
    "recompute": (0.45, 0.65),
    "flash": (0.35, 0.9),
    "fused": (0.25, 0.4),
    "triton": (5.0, 10.0),  # Triton's interpreter, on CPU
}
_FLEX_WEIGHT = 2.5


def _weight(case: Case) -> float:
    return _FLEX_WEIGHT if case.flex is not None else 1.0


def estimate(strategies: Sequence[str], cases: Sequence[Case], gradcheck: bool) -> float:
    """Roughly how long ``check`` takes, in seconds, on a machine like the one that measured
    `_CASE_SECONDS`."""
    work = sum(_weight(c) for c in cases)
    return sum(work * _CASE_SECONDS[s][gradcheck] for s in strategies)


def run_check(args: argparse.Namespace) -> int:
    """The ``check`` command: returns the exit status."""
    strategies = chosen_strategies("check", args.strategy, torch.device("cpu"), interpreted=True)
    if strategies is None:
        return 2
    cases = default_cases() + flex_cases()
    results: list[CaseResult] = []
    # what each case is judged against, computed at its first strategy and shared by the rest
    # (the loop stays strategy by strategy: gradcheck draws from the seeded global generator)
    expected = functools.cache(functools.partial(expect_case, seed=args.seed))
    torch.manual_seed(args.seed)
    bar = Progress(
        len(strategies) * len(cases),
        "check",
        weights=[_weight(c) for _ in strategies for c in cases],
        estimate=(
            estimate(strategies, cases, args.gradcheck),
            f"{len(cases)} cases x {', '.join(strategies)}; on a 2-core CPU",
        ),
    )
    with bar:
        for strategy in strategies:
            for case in cases:
                result = run_case(
                    strategy, case, args.seed, args.gradcheck, expected=expected(case)
                )
                results.append(result)
                bar.step(f"{strategy} {case.id}")
    # with --json -, stdout carries the JSON alone
    out = sys.stderr if args.json == "-" else sys.stdout
    print(check_table(results, failures_only=args.failures), file=out)
    print(check_summary(results), file=out)
    failed = any(r.failed for r in results)
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
        write_csv(check_records(results), args.csv)
        print(f"wrote {args.csv}", file=out)
    return 1 if failed else 0


def add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``check`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "check",
        help="conformance grid of every strategy against a float64 reference",
        description=(
            "Run every strategy over a grid of dtypes, masks and layouts, and FlexAttention's "
            "score functions and BlockMasks (ALiBi, soft cap, a relative-position table, "
            "documents, sliding window, prefix-LM, rows that attend nothing), and compare the "
            "output and every gradient (a score function's captured tensor's too) with a "
            "float64 reference, element by element: at most "
            "2x the error of plain PyTorch in the same dtype plus a floor derived from the "
            "magnitudes that produce each quantity (attngrad.verify.rule); on float64 cases "
            "gradcheck, double backward and forward mode against autograd through the "
            "reference (relative error at most 1e-9) and gradgradcheck.  A case a strategy "
            "declines (a score function on a kernel that cannot call one) is shown refused and "
            "fails nothing.  Exit 1 on a failed case, 2 when a strategy asked for cannot run here."
        ),
    )
    add_strategy(p, STRATEGIES, "check only this strategy (repeatable)")
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
    p.set_defaults(run=run_check)
