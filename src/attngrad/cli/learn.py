"""The ``exercise`` and ``grade`` subcommands (wired into `attngrad.cli.app`).

attngrad exercise DIR [--lang zh|en] [--force]      write the attention-backward exercise
attngrad grade FILE [--json PATH] [--timeout S]      grade a solution; exit 0 when all pass
"""

from __future__ import annotations

import argparse
import sys

from attngrad.cli.args import positive_float, write_json
from attngrad.learn.exercise import LANGS, SKELETON, write_exercise
from attngrad.learn.grade import grade

__all__ = ["add_exercise", "add_grade", "run_exercise", "run_grade"]


def run_exercise(args: argparse.Namespace) -> int:
    try:
        paths = write_exercise(args.dir, lang=args.lang, force=args.force)
    except FileExistsError as e:
        print(f"attngrad exercise: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    print(f"next: fill in the TODOs, then run `attngrad grade {paths[0]}`")
    return 0


def add_exercise(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "exercise",
        help="write the attention-backward exercise (four TODO functions) into DIR",
        description=(
            f"Write {SKELETON} (value_gradient, probability_gradient, softmax_backward and "
            "query_key_gradients to fill in, under a complete CustomAttention) and a README.md "
            "into DIR.  Existing files are kept unless --force."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="folder to write into (created if missing)")
    p.add_argument("--lang", choices=LANGS, default="zh", help="language of the text (default zh)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(run=run_exercise)


def run_grade(args: argparse.Namespace) -> int:
    try:
        report = grade(args.file, timeout=args.timeout)
    except FileNotFoundError as e:
        print(f"attngrad grade: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        write_json(report.as_dict(), args.json, sys.stdout)
    return 0 if report.passed else 1


def add_grade(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
