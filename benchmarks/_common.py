"""What the derivative benchmarks share (benchmark_jvp.py, benchmark_second.py).

Each times contenders against a first-order baseline on q, k, v: [1, HEADS, N, HEAD_DIM],
float32, causal, every contender once per round and the rounds interleaved
(`attngrad.tools.timing.interleaved`), so the machine's noise falls on all alike.  A ratio
is a median over its baseline's median, and beside it the fastest round over its baseline's
(the steadier of the two where the machine's speed varies between rounds).

    arguments, start      the flags they take alike; the threads and the machine line
    causal, causal_mask   the causal mask_mod and its BlockMask
    alibi, alibi_slopes   a learnable ALiBi through attngrad.flex_attention
    first_order           O, then the gradients of every input along a fixed dO
    measure               the table: per N every contender's median, spread and ratio
    report                a target's verdict per N, never asserted
    write                 the rows as CSV, the machine's columns on each
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import attngrad
from attngrad.cli.table import write_csv
from attngrad.tools.machine import Machine, probe
from attngrad.tools.timing import interleaved, spreads

HEADS, HEAD_DIM = 8, 64

Calls = dict[str, Callable[[], object]]
FlexAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def arguments(doc: str | None, csv: str) -> argparse.ArgumentParser:
    """A parser with the flags every derivative benchmark takes; ``csv``: where rows go."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="intra-op threads (default torch's)")
    parser.add_argument("--no-flex", action="store_true", help="leave out the ALiBi calls")
    parser.add_argument("--csv", default=csv, help=f"default {csv}; '' writes none")
    return parser


def start(args: argparse.Namespace) -> Machine:
    """Take ``--threads``, then print the machine line every figure travels with."""
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = probe(torch.float32)
    print(machine.line(), flush=True)
    return machine


def causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return i >= j


def causal_mask(n: int) -> BlockMask:
    """The causal BlockMask at Nq = Nk = n, one for every batch and head."""
    return create_block_mask(causal, None, None, n, n, device="cpu")


def alibi_slopes(heads: int = HEADS) -> torch.Tensor:
    """ALiBi's slopes [heads]: 2^(-8 h / heads) for h = 1..heads."""
    return torch.exp2(-8 * torch.arange(1, heads + 1) / heads)


def alibi(block_mask: BlockMask, strategy: str = "fused") -> FlexAttention:
    """q, k, v, m -> O: score_mod ``s - m[h] * (i - j)`` through attngrad.flex_attention,
    so the slopes m [H] may be learned (or carry tangents)."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        def score(s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s - m[h] * (i - j)

        o: torch.Tensor = attngrad.flex_attention(
            q, k, v, score_mod=score, block_mask=block_mask, strategy=strategy
        )  # one tensor: return_lse is not asked for
        return o

    return call


def first_order(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """O = fn(*inputs), then the gradient of every input along ``do`` (like O)."""
    return torch.autograd.grad(fn(*inputs), list(inputs), do)


@dataclass(frozen=True)
class Row:
    """One contender at one N, in seconds; ``ratio`` and ``fastest_ratio`` against
    ``baseline`` (None for a baseline).  ``peak_bytes`` and ``peak_beyond_io_bytes``:
    rows of a peak-memory measurement, whose times are NaN."""

    seq: int
    heads: int
    contender: str
    median_s: float
    low_s: float
    high_s: float
    ratio: float | None = None
    fastest_ratio: float | None = None
    baseline: str | None = None
    peak_bytes: int | None = None
    peak_beyond_io_bytes: int | None = None


def measure(
    seqs: Sequence[int],
    calls: Callable[[int], Calls],
    baselines: Mapping[str, str],
    repeats: int,
    heads: int = HEADS,
) -> list[Row]:
    """Time ``calls(n)`` (contender -> one call) for each n in ``seqs``, print the table
    and return its rows; ``baselines``: contender -> the contender it is a ratio of."""
    print(f"\n{'N':>6}  {'contender':<17} {'median ms':>10} {'spread ms':>17}  ratio (fastest)")
    rows: list[Row] = []
    for n in seqs:
        note(f"N={n}: timing {repeats} interleaved rounds ...")
        spread = spreads(interleaved(calls(n), repeats=repeats))
        for name, s in spread.items():
            base = baselines.get(name)
            ratio = None if base is None else s.median / spread[base].median
            fastest = None if base is None else s.low / spread[base].low
            shown = "" if base is None else f"{ratio:.2f}x ({fastest:.2f}x) {base}"
            print(
                f"{n:>6}  {name:<17} {s.median * 1e3:>10.1f} "
                f"{s.low * 1e3:>8.1f}-{s.high * 1e3:<8.1f}  {shown}",
                flush=True,
            )
            rows.append(Row(n, heads, name, s.median, s.low, s.high, ratio, fastest, base))
    return rows


def report(rows: Sequence[Row], contender: str, target: float, what: str) -> None:
    """One line per N of ``contender``'s ratio against ``target`` (at most): met or MISSED."""
    for r in rows:
        if r.contender != contender or r.ratio is None or r.fastest_ratio is None:
            continue
        verdict = "met" if r.ratio <= target else "MISSED"
        print(
            f"  {what} at N={r.seq}: {r.ratio:.2f} (fastest rounds {r.fastest_ratio:.2f}; "
            f"target <= {target}): {verdict}"
        )


def write(path: str, rows: Sequence[Row], machine: Machine) -> None:
    """The rows as CSV at ``path`` (none for ''), the machine's columns on each."""
    if not path or not rows:
        return
    write_csv([asdict(r) for r in rows], path, machine)
    print(f"wrote {path}")
