"""Second order on strategy "fused": a gradient penalty against first-order forward+backward.

    python benchmarks/benchmark_second.py [--seq 2048 4096] [--repeats 5] [--threads N]
                                          [--no-flex] [--peak-seq 16384]
                                          [--csv results/benchmark_second.csv]

B=1, H=8, d=64, float32, causal.  For each N, every contender timed once per round and the
rounds interleaved (`attngrad.tools.timing.interleaved`); a ratio is a median over its
baseline's median, and beside it the fastest round over its baseline's:

    first-order        O = attention(q, k, v, is_causal=True, strategy="fused"), then dq, dk,
                       dv (torch.autograd.grad with a fixed dO): the baseline
    penalty            the gradient penalty: g = grad(<O, dO>, (q, k, v), create_graph=True),
                       then grad(sum of |g_i|², (q, k, v)): forward, a first-order backward
                       with its graph and the backward of that backward, on fused
                                                                   target <= 3.2x first-order
    penalty-flash      the same penalty on strategy="flash" (reported)
    penalty-sdpa-math  the same penalty through F.scaled_dot_product_attention under
                       sdpa_kernel(SDPBackend.MATH) (reported)

and a learnable ALiBi (slopes [H] requiring grad, score_mod ``s - m[h] * (i - j)``) through
``attngrad.flex_attention`` with a causal BlockMask, on fused:

    flex-first-order   O, then dq, dk, dv and the slopes' gradient: the baseline
    flex-penalty       the penalty over (q, k, v, slopes)      target <= 3.2x flex-first-order

Then memory: the peak, beyond its inputs and outputs (O and the three results), of one
Hessian-vector product by double backward at B=1, H=1, N=--peak-seq, d=64, causal, on
fused: g = grad(<O, dO>, (q, k, v), create_graph=True), hvp = grad(<g, w>, (q, k, v))
(`attngrad.tools.bench_hvp.peak_only`, loss "dot"; on CPU the profiler's allocation
events, `attngrad.tools.memory.measure_peak_bytes`)          target < 256 MiB

Nothing here asserts a target; the script prints each figure with its target and verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from _common import (
    HEAD_DIM,
    HEADS,
    Calls,
    Row,
    alibi,
    alibi_slopes,
    arguments,
    causal_mask,
    first_order,
    measure,
    note,
    report,
    start,
    write,
)
from attngrad.tools.bench_hvp import peak_only
from attngrad.tools.memory import format_bytes
from attngrad.tools.paths import SDPA_MATH, path_fn

TARGET = 3.2  # penalty / first-order, fused and flex alike
PEAK_TARGET = 256 * 2**20  # bytes beyond I/O of one HVP at B=1, H=1, N=16384 (below)
BASELINES = {
    "penalty": "first-order", "penalty-flash": "first-order",
    f"penalty-{SDPA_MATH}": "first-order", "flex-penalty": "flex-first-order",
}  # fmt: skip


def penalty(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The gradient of sum |g_i|² w.r.t. ``inputs``, g = the gradients of <fn(*inputs), do>."""
    out = fn(*inputs)
    g = torch.autograd.grad((out * do).sum(), list(inputs), create_graph=True)
    return torch.autograd.grad(sum(x.square().sum() for x in g), list(inputs))  # type: ignore[arg-type]


def calls(n: int, flex: bool) -> Calls:
    """{contender: one timed call} at N = n (module docstring)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(4))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    fused, flash, sdpa_math = (path_fn(p, causal=True) for p in ("fused", "flash", SDPA_MATH))
    out: Calls = {
        "first-order": lambda: first_order(fused, leaves, do),
        "penalty": lambda: penalty(fused, leaves, do),
        "penalty-flash": lambda: penalty(flash, leaves, do),
        f"penalty-{SDPA_MATH}": lambda: penalty(sdpa_math, leaves, do),
    }
    if not flex:
        return out
    flex_alibi = alibi(causal_mask(n))
    learnable = (*leaves, alibi_slopes().requires_grad_())
    out["flex-first-order"] = lambda: first_order(flex_alibi, learnable, do)
    out["flex-penalty"] = lambda: penalty(flex_alibi, learnable, do)
    return out


def peak(n: int) -> Row:
    """The HVP's peak memory at B=1, H=1, N=n on fused (module docstring), as a row."""
    got = peak_only(n, ["fused"], heads=1, head_dim=HEAD_DIM, causal=True, loss="dot")["fused"]
    assert got is not None  # peak_only skips only a contender given an estimate
    nan = float("nan")
    return Row(n, 1, "hvp-peak", nan, nan, nan, peak_bytes=got[0], peak_beyond_io_bytes=got[1])


def main() -> None:
    parser = arguments(__doc__, "results/benchmark_second.csv")
    parser.add_argument(
        "--peak-seq", type=int, default=16384, help="N of the B=1 H=1 HVP peak (0: skip)"
    )
    args = parser.parse_args()
    machine = start(args)
    rows = measure(args.seq, lambda n: calls(n, not args.no_flex), BASELINES, args.repeats)
    if args.peak_seq:
        note(f"N={args.peak_seq}: the HVP's peak memory at B=1, H=1 ...")
        rows.append(peak(args.peak_seq))

    print("\ntargets (reported, not asserted):")
    report(rows, "penalty", TARGET, "fused penalty / first-order")
    report(rows, "flex-penalty", TARGET, "fused ALiBi penalty / flex first-order")
    for r in rows:
        if r.peak_beyond_io_bytes is not None:
            verdict = "met" if r.peak_beyond_io_bytes < PEAK_TARGET else "MISSED"
            print(
                f"  fused HVP peak beyond I/O at B=1 H=1 N={r.seq}: "
                f"{format_bytes(r.peak_beyond_io_bytes)} (peak {format_bytes(r.peak_bytes)}; "
                f"target < {format_bytes(PEAK_TARGET)}): {verdict}"
            )
    write(args.csv, rows, machine)


if __name__ == "__main__":
    main()
