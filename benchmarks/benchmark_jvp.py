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

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

import attngrad
from _common import (
    HEAD_DIM,
    HEADS,
    Calls,
    alibi,
    alibi_slopes,
    arguments,
    causal_mask,
    first_order,
    measure,
    report,
    start,
    write,
)
from attngrad.strategies.fused.strategy import Fused

TARGET = 0.8  # jvp / first-order
BASELINES = {
    "jvp": "first-order", "jvp-two-pass": "first-order", "jvp-tiled": "first-order",
    "flex-jvp": "flex-first-order", "flex-jvp-two-pass": "flex-first-order",
    "flex-jvp-tiled": "flex-first-order",
}  # fmt: skip


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


def calls(n: int, flex: bool) -> Calls:
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

    out: Calls = {
        "first-order": lambda: first_order(fused, leaves, do),
        "jvp": lambda: torch.func.jvp(fused, (q, k, v), (tq, tk, tv)),
        "jvp-two-pass": jvp_two_pass,
        "jvp-tiled": jvp_tiled,
    }
    if not flex:
        return out
    flex_alibi = alibi(causal_mask(n))
    slopes = alibi_slopes()
    t_slopes = torch.randn(HEADS, generator=g)
    learn = slopes.clone().requires_grad_()

    out["flex-first-order"] = lambda: first_order(flex_alibi, (*leaves, learn), do)
    out["flex-jvp"] = lambda: torch.func.jvp(flex_alibi, (q, k, v, slopes), (tq, tk, tv, t_slopes))

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
    args = arguments(__doc__, "results/benchmark_jvp.csv").parse_args()
    machine = start(args)
    rows = measure(args.seq, lambda n: calls(n, not args.no_flex), BASELINES, args.repeats)
    print("\ntargets (reported, not asserted):")
    report(rows, "jvp", TARGET, "fused jvp / first-order")
    report(rows, "flex-jvp", TARGET, "fused flex-jvp (learnable ALiBi) / flex-first-order")
    write(args.csv, rows, machine)


if __name__ == "__main__":
    main()
