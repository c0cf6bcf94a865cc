"""Forward+backward time of the explicit strategy against SDPA's MATH backend on CPU.

    python benchmarks/benchmark_cpu.py [--batch 1 --heads 8 --seq 2048 --head-dim 64]
                                       [--repeats 7] [--csv results/benchmark_cpu.csv]

Both run in this one process, interleaved round by round; the median ratio
explicit / SDPA-MATH is printed (target: <= 0.9), under a line naming the
machine (`attngrad.tools.machine`), whose columns every CSV row carries too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngrad
from attngrad.cli.table import write_csv
from attngrad.tools.machine import probe
from attngrad.tools.timing import interleaved, medians


def forward_backward(fn, q, k, v, dout, **kwargs):
    def run() -> None:
        out = fn(q, k, v, **kwargs)
        torch.autograd.grad(out, (q, k, v), dout)

    return run


def sdpa_math(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--csv", default="results/benchmark_cpu.csv")
    args = parser.parse_args()

    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape)
    contenders = {
        "sdpa_math": forward_backward(sdpa_math, q, k, v, dout, is_causal=args.causal),
        "explicit": forward_backward(
            attngrad.attention, q, k, v, dout, is_causal=args.causal, strategy="explicit"
        ),
    }
    machine = probe(torch.float32)
    times = medians(interleaved(contenders, repeats=args.repeats))
    ratio = times["explicit"] / times["sdpa_math"]
    print(machine.line())
    print(
        f"B={args.batch} H={args.heads} N={args.seq} d={args.head_dim} float32 causal={args.causal}"
    )
    for name, t in times.items():
        print(f"  {name:<10} forward+backward {t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"  explicit / sdpa_math = {ratio:.3f}  (target <= 0.9)")
    records = [
        {
            "batch": args.batch,
            "heads": args.heads,
            "seq": args.seq,
            "head_dim": args.head_dim,
            "causal": args.causal,
            "contender": name,
            "median_s": f"{t:.6f}",
            "ratio_vs_sdpa_math": f"{t / times['sdpa_math']:.4f}",
        }
        for name, t in times.items()
    ]
    write_csv(records, args.csv, machine)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
