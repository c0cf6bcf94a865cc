"""``attngrad verify MODULE:FUNCTION [--flex] [--json PATH|-] [--seed N] [--no-gradcheck]``.

Judges any function with SDPA's signature (`attngrad.verify.verify`): the conformance
grid against float64, gradcheck, determinism and no input modified, after probing
which features the function takes.  A function with FlexAttention's signature
(``--flex``, or found by its ``score_mod``/``block_mask`` parameters) is judged on the
flex grid: score functions, their captured tensors' gradients and BlockMasks; one
without backward on its output alone, reported as lacking backward.  Exit 0 when everything that ran passed, 1 on a
failure, 2 when the function cannot be loaded.  Wired into the ``attngrad`` command by
`add_verify`; `verify_table` shows the result.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import attngrad
from attngrad.cli.table import columns, write_json
from attngrad.core.progress import Progress
from attngrad.verify import verify as external
from attngrad.verify.verify import Result

__all__ = ["add_verify", "run_verify", "verify_table"]


def verify_table(result: Result) -> str:
    """The cases (id, status, worst error/bound, what failed), the checks and a summary line."""
    word = {None: "unsupported", True: "pass", False: "FAIL"}
    rows = []
    for c in result.cases:
        worst = "NaN" if any(math.isnan(e) for e in c.errors.values()) else "-"
        if c.ratios and worst == "-":
            worst = f"{max(c.ratios.values()):.3g}"
        rows.append([c.id, word[c.passed], worst, c.message if c.passed is not True else ""])
    head, lines = columns(["case", "verdict", "worst err/bound", "what failed"], rows, left=4)
    lines = [head, *lines, ""]
    checks = [[k.name, word[k.passed], k.message] for k in result.checks]
    head, check_lines = columns(["check", "verdict", "detail"], checks, left=3)
    lines += [head, *check_lines]
    counts = {
        w: sum(word[c.passed] == w for c in result.cases) for w in ("pass", "FAIL", "unsupported")
    }
    failed_checks = sum(k.passed is False for k in result.checks)
    lines.append("")
    lines.append(
        f"{'PASSED' if result.passed else 'FAILED'}: {counts['pass']} cases pass, "
        f"{counts['FAIL']} fail, {counts['unsupported']} unsupported"
        + (f" ({', '.join(result.unsupported)})" if result.unsupported else "")
        + f"; {failed_checks} checks fail"
    )
    return "\n".join(lines)


def run_verify(args: argparse.Namespace) -> int:
    """The ``verify`` command: returns the exit status."""
    try:
        fn = external.load(args.spec)
    except (ImportError, ValueError) as e:
        print(f"attngrad verify: error: {e}", file=sys.stderr)
        return 2
    flex = args.flex or external.flex_signature(fn)
    torch.manual_seed(args.seed)
    with Progress(external.steps(gradcheck=args.gradcheck, flex=flex), "verify") as bar:
        result = external.verify(
            fn, progress=bar.step, seed=args.seed, gradcheck=args.gradcheck, flex=flex
        )
    # with --json -, stdout carries the JSON alone
    out = sys.stderr if args.json == "-" else sys.stdout
    signature = " (FlexAttention's signature)" if flex else ""
    print(f"attngrad verify {args.spec}{signature}", file=out)
    print(verify_table(result), file=out)
    if args.json:
        payload = {
            "spec": args.spec,
            "flex": flex,
            "torch": torch.__version__,
            "attngrad": attngrad.__version__,
            "seed": args.seed,
            **result.as_dict(),
        }
        write_json(payload, args.json, out)
    return 0 if result.passed else 1


def add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``verify`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "verify",
        help="judge any function with SDPA's (or FlexAttention's) signature against the float64 "
        "reference",
        description=(
            "Load MODULE:FUNCTION (or path/to/file.py:FUNCTION), a function called like "
            "torch.nn.functional.scaled_dot_product_attention, probe which features it takes "
            "(dtypes, bool and float masks and the float mask's gradient, causal, GQA, "
            "Nq != Nk, dv != d, 3-d and 5-d inputs: a probe that raises marks the feature "
            "unsupported), then run the conformance grid on what it takes, element by element "
            "against float64 (at most 2x the error of plain PyTorch plus a floor from the "
            "magnitudes: attngrad.verify.rule), gradcheck on float64, a bitwise determinism check "
            "and a check that no input is modified.  With --flex (or a function whose parameters "
            "name score_mod or block_mask), a function called like "
            "torch.nn.attention.flex_attention.flex_attention is judged instead on score "
            "functions (ALiBi, soft cap, a relative-position table, with their captured "
            "tensors' gradients) and BlockMasks (documents, sliding window, prefix-LM, rows "
            "that attend nothing); one without backward is judged on its output and reported "
            "as lacking backward.  Exit 0 when everything that ran passed, 1 on a failure, 2 "
            "when the function cannot be loaded."
        ),
    )
    p.add_argument(
        "spec",
        metavar="MODULE:FUNCTION",
        help="e.g. torch.nn.functional:scaled_dot_product_attention or path/to/file.py:attn",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH; '-' writes them to stdout (the table "
        "then goes to stderr); unsupported features: 'unsupported' (feature -> what the "
        'probe raised), their cases and checks with "passed": null',
    )
    p.add_argument(
        "--flex",
        action="store_true",
        help="the function has FlexAttention's signature, fn(query, key, value, score_mod=None, "
        "block_mask=None, scale=None, enable_gqa=False) (found by itself where the function "
        "names score_mod or block_mask)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument(
        "--no-gradcheck", dest="gradcheck", action="store_false", help="skip gradcheck (faster)"
    )
    p.set_defaults(run=run_verify)
