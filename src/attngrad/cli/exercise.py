"""``attngrad exercise DIR [--lang en|zh] [--force]``: write the attention-backward exercise.

The skeleton and its README (`attngrad.learn.exercise`): four TODO functions under a
complete CustomAttention, for `attngrad.cli.grade` to grade.
"""

from __future__ import annotations

import argparse
import sys

from attngrad.learn.exercise import LANGS, SKELETON, write_exercise

__all__ = ["add_exercise", "run_exercise"]


def run_exercise(args: argparse.Namespace) -> int:
    """The ``exercise`` command: returns the exit status."""
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
    """Add the ``exercise`` subcommand to ``attngrad``'s subparsers."""
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
    p.add_argument(
        "--lang",
        choices=LANGS,
        default=None,
        help="language of the text: en or zh (default: zh where the locale is Chinese, else en)",
    )
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(run=run_exercise)
