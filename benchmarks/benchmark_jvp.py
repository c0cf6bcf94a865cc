"""Forward mode on strategy "fused": torch.func.jvp against first-order forward+backward, as ratios.

    python benchmarks/benchmark_jvp.py [--seq 2048 4096] [--repeats 5] [--threads N]
                                       [--no-flex] [--csv results/benchmark_jvp.csv]

B=1, H=8, d=64, float32, causal.  For each N, every contender timed once per round and the
rounds interleaved (`attngrad.tools.timing.interleaved`), so the machine's noise falls on
all alike; a ratio is a median over its baseline's median, and beside it the fastest round
over its baseline's (the steadier of the two where the machine's speed varies between
rounds):

    first-order  O = attention(q, k, v, is_causal=True, strategy="fused"), then dq, dk, dv
                 (torch.autograd.grad with a fixed dO): the baseline
    jvp          torch.func.jvp of the same call along tangents of q, k, v: O and O' in one
                 pass, fused's forward_tangent kernel (csrc/tangent.h)  target <= 0.8x first-order
    jvp-two-pass the same jvp as autograd's primal forward, then fused's tangent kernel
                 (the path before the one pass; reported)
    jvp-tiled    the same jvp through the shared tiled pass in tensor ops
                 (`attngrad.autograd.tangent.tiled_tangent`), the path before the kernel
                 (reported)

and a learnable ALiBi (slopes [H]) through ``attngrad.flex_attention`` with a causal
BlockMask, a relative score function, whose term D and its tangent D' the kernels add by
diagonal:

    flex-first-order   O, then dq, dk, dv and the slopes' gradient: the baseline
    flex-jvp           torch.func.jvp along tangents of q, k, v and the slopes: O and O'
                       in one pass, D' from the slopes' tangent  target <= 0.8x
    flex-jvp-two-pass  the same jvp as autograd's primal forward, then the tangent kernel
                       (reported)
    flex-jvp-tiled     the same through the shared tiled pass (reported)

Nothing here asserts a target; the script prints each ratio with its target and verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch.nn.attention.flex_attention import create_block_mask

import attngrad
from attngrad.strategies.fused.strategy import Fused
from attngrad.tools.machine import probe
from attngrad.tools.timing import interleaved, spreads

HEADS, HEAD_DIM = 8, 64
TARGET = 0.8  # jvp / first-order
BASELINES = {
    "jvp": "first-order", "jvp-two-pass": "first-order", "jvp-tiled": "first-order",
    "flex-jvp": "flex-first-order", "flex-jvp-two-pass": "flex-first-order",
    "flex-jvp-tiled": "flex-first-order",
}  # fmt: skip
TARGETS = ("jvp", "flex-jvp")  # the contenders held to TARGET

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def tiled() -> Iterator[None]:
    """fused's forward mode through the shared tiled pass (its kernel turned off)."""
    with two_pass(), mock.patch.object(Fused, "tangent", lambda self, *args: None):
        yield


@contextlib.contextmanager
def two_pass() -> Iterator[None]:
    """fused's forward mode as autograd's forward, then the tangent kernel (no one pass)."""
    with mock.patch.object(Fused, "one_pass_tangent", lambda self, problem, tangents: False):
        yield


def causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return i >= j


def calls(n: int, flex: bool) -> dict[str, Callable[[], object]]:
    """{contender: one timed call} at N = n (module docstring)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do, tq, tk, tv = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(7))
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(q, k, v, is_causal=True, strategy="fused")

    def jvp_tiled() -> object:
        with tiled():
            return torch.func.jvp(fused, (q, k, v), (tq, tk, tv))

    def jvp_two_pass() -> object:
        with two_pass():
            return torch.func.jvp(fused, (q, k, v), (tq, tk, tv))

    out: dict[str, Callable[[], object]] = {
        "first-order": lambda: torch.autograd.grad(fused(*leaves), leaves, do),
        "jvp": lambda: torch.func.jvp(fused, (q, k, v), (tq, tk, tv)),
        "jvp-two-pass": jvp_two_pass,
        "jvp-tiled": jvp_tiled,
    }
    if not flex:
        return out
    mask = create_block_mask(causal, None, None, n, n, device="cpu")
    slopes = torch.exp2(-8 * torch.arange(1, HEADS + 1) / HEADS)
    t_slopes = torch.randn(HEADS, generator=g)
    learn = slopes.clone().requires_grad_()

    def alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        def score(s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s - m[h] * (i - j)

        return attngrad.flex_attention(q, k, v, score_mod=score, block_mask=mask, strategy="fused")

    out["flex-first-order"] = lambda: torch.autograd.grad(
        alibi(*leaves, learn), (*leaves, learn), do
    )
    out["flex-jvp"] = lambda: torch.func.jvp(alibi, (q, k, v, slopes), (tq, tk, tv, t_slopes))

    def flex_jvp_two_pass() -> object:
        with two_pass():
            return out["flex-jvp"]()

    def flex_jvp_tiled() -> object:
        with tiled():
            return out["flex-jvp"]()

    out["flex-jvp-two-pass"] = flex_jvp_two_pass
    out["flex-jvp-tiled"] = flex_jvp_tiled
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="intra-op threads (default torch's)")
    parser.add_argument("--no-flex", action="store_true", help="leave out the ALiBi calls")
    parser.add_argument("--csv", default="results/benchmark_jvp.csv")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    print(probe(torch.float32).line(), flush=True)
    rows: list[dict[str, object]] = []
    print(f"\n{'N':>6}  {'contender':<17} {'median ms':>10} {'spread ms':>17}  ratio (fastest)")
    for n in args.seq:
        _note(f"N={n}: timing {args.repeats} interleaved rounds ...")
        times = interleaved(calls(n, not args.no_flex), repeats=args.repeats)
        spread = spreads(times)
        for name, s in spread.items():
            base = BASELINES.get(name)
            ratio = None if base is None else s.median / spread[base].median
            fastest = None if base is None else s.low / spread[base].low
            shown = "" if base is None else f"{ratio:.2f}x ({fastest:.2f}x) {base}"
            print(
                f"{n:>6}  {name:<17} {s.median * 1e3:>10.1f} "
                f"{s.low * 1e3:>8.1f}-{s.high * 1e3:<8.1f}  {shown}"
            )
            rows.append({"seq": n, "contender": name, "median_s": s.median, "low_s": s.low,
                         "high_s": s.high, "ratio": ratio, "fastest_ratio": fastest,
                         "baseline": base})  # fmt: skip

    print("\ntargets (reported, not asserted):")
    for r in rows:
        if r["contender"] in TARGETS:
            ratio, fastest = float(r["ratio"]), float(r["fastest_ratio"])  # type: ignore[arg-type]
            verdict = "met" if ratio <= TARGET else "MISSED"
            print(f"  fused {r['contender']} / {r['baseline']} at N={r['seq']}: {ratio:.2f} "
                  f"(fastest rounds {fastest:.2f}; target <= {TARGET}): {verdict}")  # fmt: skip
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
