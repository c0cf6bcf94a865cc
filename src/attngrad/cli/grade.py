"""``attngrad grade FILE [--json PATH] [--timeout S]``: grade a solution of the exercise.

The grader (`attngrad.learn.grade`) imports FILE in a child process and judges each
TODO function, then CustomAttention end to end.  Exit 0 when every stage passes, 1
otherwise, 2 when FILE is missing.  `grade_table` shows the stages.
"""

from __future__ import annotations

import argparse
import sys

from attngrad.cli.args import positive_float
from attngrad.cli.table import columns, verdict, write_json
from attngrad.learn.grade import Report, grade

__all__ = ["add_grade", "grade_table", "run_grade"]


def grade_table(report: Report) -> str:
    """One row per stage (verdict, diagnosis, hint), each stage's message, then the verdict."""
    rows = [[s.name, verdict(s.passed), s.diagnosis or "-", s.hint or "-"] for s in report.stages]
    head, lines = columns(["stage", "verdict", "diagnosis", "hint"], rows, left=4)
    rule = "-" * max(len(line) for line in [head, *lines])
    notes = [f"{s.name}: {s.message}" for s in report.stages if s.message]
    result = "all stages pass" if report.passed else "some stages fail"
    return "\n".join([head, rule, *lines, "", *notes, "", f"{report.path}: {result}"])


def run_grade(args: argparse.Namespace) -> int:
    """The ``grade`` command: returns the exit status."""
    try:
        report = grade(args.file, timeout=args.timeout)
    except FileNotFoundError as e:
        print(f"attngrad grade: {e}", file=sys.stderr)
        return 2
    print(grade_table(report))
    if args.json:
        write_json(report.as_dict(), args.json, sys.stdout)
    return 0 if report.passed else 1


def add_grade(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``grade`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "grade",
        help="grade a solution of the exercise; exit 0 when every stage passes",
        description=(
            "Import FILE in a child process and grade each TODO function on its own (fed "
            "correct inputs, on non-square, square, batched, d != N and d = N probes), then "
            "CustomAttention end to end (forward, backward, float64 gradcheck, input "
            "contract).  A failing stage names the known mistake its numbers match.  Exit 0 "
            "when every stage passes, 1 otherwise, 2 when FILE is missing."
        ),
    )
    p.add_argument("file", metavar="FILE", help="the learner's module, e.g. attention_exercise.py")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="seconds each stage (and the import) may take (default 30)",
    )
    p.set_defaults(run=run_grade)
