"""The ``attngrad`` command.

attngrad check   [--strategy NAME ...] [--json PATH] [--seed N] [--no-gradcheck]
                 the conformance grid; exit 1 on a failed case, 2 on a strategy that can't run
attngrad ledger  [--seq-q N ...] [--sweep N ...]   saved bytes and peak memory per path
attngrad explain [--strategy NAME ...]             the grad_fn graph and saved tensors per path
attngrad bench   [--seq N ...] [--strategy NAME]   time against SDPA's MATH and FLASH backends
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from attngrad import bench, explain, ledger
from attngrad.progress import Progress
from attngrad.strategies import STRATEGIES, available, refuse_unavailable, skipped
from attngrad.verify import GRADIENTS, CaseResult, default_cases, format_error, run_case

__all__ = ["main"]


def _row(r: CaseResult) -> str:
    errs = " ".join(f"{format_error(r.errors.get(g)):>8}" for g in GRADIENTS)
    rule = "pass" if r.rule_passed and not r.nan else ("NaN" if r.nan else "FAIL")
    grad = {None: "-", True: "pass", False: "FAIL"}[r.gradcheck_passed]
    line = f"{r.strategy:<10} {r.case:<40} {errs} {rule:>5} {grad:>9}"
    return line + (f"  {r.message}" if r.message else "")


def _check(args: argparse.Namespace) -> int:
    cpu = torch.device("cpu")
    if refuse_unavailable("check", args.strategy, cpu):
        return 2
    strategies = args.strategy or list(available(cpu, interpreted=True))
    for line in [] if args.strategy else skipped(cpu, interpreted=True):
        print(line, file=sys.stderr)
    cases = default_cases()
    results: list[CaseResult] = []
    torch.manual_seed(args.seed)
    with Progress(len(strategies) * len(cases), "check") as bar:
        for strategy in strategies:
            for case in cases:
                results.append(run_case(strategy, case, args.seed, gradcheck=args.gradcheck))
                bar.step(f"{strategy} {case.id}")
    header = " ".join(f"{g:>8}" for g in GRADIENTS)
    print(f"{'strategy':<10} {'case':<40} {header} {'rule':>5} {'gradcheck':>9}")
    for r in results:
        print(_row(r))
    failed = [r for r in results if not r.passed]
    print(
        f"\n{len(results) - len(failed)} passed, {len(failed)} failed "
        "(max abs error vs float64; rule: float64 <= 1e-9, others <= 2x plain PyTorch + a few ulps)"
    )
    if args.json:
        payload = {
            "torch": torch.__version__,
            "strategies": strategies,
            "passed": not failed,
            "results": [r.as_dict() for r in results],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngrad", description="Attention with hand-written backward passes: check them."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="conformance grid of every strategy against a float64 reference"
    )
    check.add_argument(
        "--strategy",
        action="append",
        choices=STRATEGIES,
        help="check only this strategy (repeatable)",
    )
    check.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    check.add_argument(
        "--no-gradcheck", dest="gradcheck", action="store_false", help="skip gradcheck (faster)"
    )
    check.set_defaults(run=_check)
    ledger.register(sub)
    explain.register(sub)
    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
