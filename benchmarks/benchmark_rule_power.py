"""The error rule's power: how far planted bugs fail it and how far correct code passes it.

    python benchmarks/benchmark_rule_power.py [--dtype bfloat16 float16 float32] [--blocks 64 64]
                                    [--seed 0] [--threads 1] [--csv results/rule_power.csv]

Over a grid of realistic cases (N from 97 to 1024, d from 59 to 128, causal, bool and
float masks, GQA, Nq != Nk; flash on several tiles each way), `attngrad.verify.planted.margins`
judges each planted bug (a copy of strategy "flash" with one mistake in one dtype) on
the cases of its dtype and correct code (explicit, recompute, flash on the same tiles,
PyTorch's SDPA) on every case; every run but SDPA's has its returned lse judged too.
Prints, under the machine line, two Markdown tables of ratios (error / bound at the
worst element; > 1 fails the rule), each with the quantity it is of (out, a gradient,
lse): per bug, the smallest over the cases of its largest ratio on the quantities it
breaks, beside correct code's worst ratio in the bug's dtype and their quotient (the
gap); per correct code and dtype, its worst ratio.  Writes one CSV row per figure.
Exit 1 when a bug passes the rule somewhere or correct code fails it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from attngrad.cli.table import markdown, write_csv
from attngrad.core.contract import DTYPES, Shapes, dtype_name
from attngrad.tools.machine import probe
from attngrad.verify.cases import Case
from attngrad.verify.planted import BLOCKS, BUGS, CodeRatio, Margins, margins

# (shapes, mask): q [*lead, Hq, Nq, d]; odd sizes on purpose, so no tile divides them
LAYOUTS = [
    (Shapes((1,), 1, 1, 1024, 1024, 128, 128), "none"),
    (Shapes((1,), 2, 2, 97, 97, 59, 59), "causal"),
    (Shapes((1,), 2, 2, 1024, 1024, 64, 64), "causal"),
    (Shapes((1,), 4, 2, 257, 333, 64, 64), "float"),  # GQA, Nq != Nk, the mask's gradient
    (Shapes((2,), 2, 2, 512, 512, 111, 111), "bool"),  # with a row that attends nothing
]


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def bug_table(m: Margins) -> list[str]:
    header = ["bug", "dtype", "breaks", "smallest ratio", "of", "on case", "correct's worst",
              "gap"]  # fmt: skip
    rows = []
    for r in m.bugs:
        breaks, worst = ", ".join(r.bug.breaks), m.worst_correct(r.bug.dtype)
        figures = [f"{r.ratio:.3g}", r.quantity, r.case, f"{worst:.3g}", f"{m.power(r):.3g}"]
        rows.append([r.bug.name, dtype_name(r.bug.dtype), breaks, *figures])
    return markdown(header, rows)


def _cell(c: CodeRatio) -> str:
    return f"{c.ratio:.3g} ({c.quantity})"


def correct_table(m: Margins) -> list[str]:
    dtypes = list(dict.fromkeys(c.dtype for c in m.correct))
    codes = list(dict.fromkeys(c.code for c in m.correct))
    worst = {(c.code, c.dtype): c for c in m.correct}
    rows = [[code, *(_cell(worst[code, d]) for d in dtypes)] for code in codes]
    return markdown(["code", *map(dtype_name, dtypes)], rows)


def _record(
    kind: str, name: str, dtype: torch.dtype, ratio: float, quantity: str, case: str
) -> dict[str, object]:
    return {"kind": kind, "name": name, "dtype": dtype_name(dtype), "ratio": f"{ratio:.6g}",
            "quantity": quantity, "case": case}  # fmt: skip


def records(m: Margins) -> list[dict[str, object]]:
    """One CSV row per figure: each bug's smallest ratio, each correct code's worst per dtype."""
    bugs = [_record("bug", r.bug.name, r.bug.dtype, r.ratio, r.quantity, r.case) for r in m.bugs]
    return bugs + [
        _record("correct", c.code, c.dtype, c.ratio, c.quantity, c.case) for c in m.correct
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=("bfloat16", "float16", "float32"),
        default=["bfloat16", "float16", "float32"],
    )  # fmt: skip
    parser.add_argument("--blocks", type=int, nargs=2, default=list(BLOCKS), metavar=("Q", "K"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default torch's); the ratios do not depend on it",
    )
    parser.add_argument("--csv", default="results/rule_power.csv")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = probe(torch.float32)
    print(machine.line(), flush=True)
    dtypes = [DTYPES[d] for d in args.dtype]
    cases = [Case(shapes, dtype, mask) for dtype in dtypes for shapes, mask in LAYOUTS]
    blocks = (args.blocks[0], args.blocks[1])
    bugs = [b for b in BUGS if b.dtype in dtypes]
    m = margins(cases, bugs, blocks, args.seed, progress=_note)

    print(f"\nflash's tiles {blocks[0]}x{blocks[1]}; cases: {', '.join(c.id for c in cases)}")
    print("\nplanted bugs: the smallest ratio over the cases of the bug's dtype (> 1: caught)\n")
    print("\n".join(bug_table(m)))
    print("\ncorrect code: the worst ratio over the cases (<= 1: passes)\n")
    print("\n".join(correct_table(m)))

    missed = [f"{r.bug.id} ({r.ratio:.3g} on {r.case})" for r in m.bugs if not r.caught]
    failed = [f"{c.code} {dtype_name(c.dtype)} ({c.ratio:.3g} on {c.case})"
              for c in m.correct if c.ratio > 1.0]  # fmt: skip
    print(f"\nbugs the rule passes: {', '.join(missed) or 'none'}")
    print(f"correct code the rule fails: {', '.join(failed) or 'none'}")
    if args.csv:
        write_csv(records(m), args.csv, machine)
        print(f"wrote {args.csv}")
    return 1 if missed or failed else 0


if __name__ == "__main__":
    sys.exit(main())
