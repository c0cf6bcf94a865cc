"""TFLOP/s of strategy "triton" against SDPA's CUDA backends, bfloat16, on one GPU.

    python benchmarks/benchmark_gpu.py [--batch 2 --heads 16] [--head-dim 64 128]
        [--seq 1024 2048 4096 8192 16384] [--causal both] [--csv results/benchmark_gpu.csv]

For each head dim, sequence length and causal mode it times forward, backward
and forward+backward of attngrad's triton strategy and of
``scaled_dot_product_attention`` under each of FLASH_ATTENTION,
EFFICIENT_ATTENTION and CUDNN_ATTENTION that this machine has, with
``triton.testing.do_bench`` (CUDA events, median).  A contender that fails on
a shape (a backend without it, a kernel that does not compile) is left out of
that shape.  Each row goes to the CSV as soon as it is measured, so a run cut
short keeps what it measured.  FLOPs follow
`attngrad.tools.bench_step.flops` (forward 4*B*H*N*N*d, half when causal; backward 2.5x).
The GPU's bfloat16 matmul rate is measured first, in the same run, and printed
with the GPU's name and the host's threads (`attngrad.tools.machine.Machine`), which
every CSV row carries too.  Ratios are triton's speed over each backend's
(above 1: triton faster).
"""

from __future__ import annotations

import argparse
import csv
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngrad
from attngrad.tools.bench_step import PASSES, flops
from attngrad.tools.machine import Machine, processor_name

BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
}


def gpu_machine(n: int = 8192) -> Machine:
    """This GPU and its bfloat16 GEMM rate: an n x n x n product timed by do_bench."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    device = torch.device("cuda")
    return Machine(
        processor_name(device), torch.get_num_threads(), "bfloat16", n, 2 * n**3 / ms / 1e6
    )


def attention_fn(name: str, causal: bool) -> Callable[..., torch.Tensor]:
    if name == "triton":
        return lambda q, k, v: attngrad.attention(q, k, v, is_causal=causal, strategy="triton")

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(BACKENDS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


def pass_fn(fn: Callable[..., torch.Tensor], pass_: str, q, k, v, dout) -> Callable[[], object]:
    """A callable timing one pass; backward alone replays a kept graph."""
    if pass_ == "forward":
        return lambda: fn(q, k, v)
    if pass_ == "backward":
        out = fn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def both() -> object:
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return both


def runs(name: str, causal: bool, q, k, v, dout) -> bool:
    """Whether contender ``name`` accepts this problem on this machine."""
    try:
        torch.autograd.grad(attention_fn(name, causal)(q, k, v), (q, k, v), dout)
    except Exception as e:  # SDPA backends raise RuntimeError; Triton its own errors
        print(f"  {name}: left out at this shape ({type(e).__name__}: {str(e).splitlines()[0]})")
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--csv", default="results/benchmark_gpu.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_gpu.py needs a CUDA GPU")

    torch.manual_seed(0)
    machine = gpu_machine()
    print(machine.line())
    modes = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    with open(args.csv or os.devnull, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[*CSV_COLUMNS, *machine.columns()])
        writer.writeheader()
        print(f"{'d':>4} {'N':>6} {'causal':>6} {'pass':<17} {'contender':<15} {'ms':>8}", end="")
        print(f" {'TFLOP/s':>8} {'triton/it':>9}")
        for d in args.head_dim:
            for n in args.seq:
                for causal in modes:
                    measure(args, d, n, causal, machine, writer)
                    f.flush()
    if args.csv:
        print(f"wrote {args.csv}")


CSV_COLUMNS = [
    "batch", "heads", "head_dim", "seq", "causal", "dtype", "pass", "contender",
    "ms", "tflops",
]  # fmt: skip


def measure(
    args: argparse.Namespace, d: int, n: int, causal: bool, machine: Machine, writer: csv.DictWriter
) -> None:
    """Every pass of every contender at one shape: a printed line and a CSV row each."""
    shape = (args.batch, args.heads, n, d)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    names = [c for c in ("triton", *BACKENDS) if runs(c, causal, q, k, v, dout)]
    for pass_ in PASSES:
        times, rates = {}, {}
        for name in names:
            fn = pass_fn(attention_fn(name, causal), pass_, q, k, v, dout)
            times[name] = triton.testing.do_bench(fn, return_mode="median")
            rates[name] = flops(args.batch, args.heads, n, n, d, causal, pass_) / times[name] / 1e9
            writer.writerow(
                {
                    "batch": args.batch, "heads": args.heads, "head_dim": d, "seq": n,
                    "causal": causal, "dtype": "bfloat16", "pass": pass_, "contender": name,
                    "ms": times[name], "tflops": rates[name], **machine.columns(),
                }
            )  # fmt: skip
        for name in names:
            ratio = rates["triton"] / rates[name] if "triton" in rates else float("nan")
            print(
                f"{d:>4} {n:>6} {causal!s:>6} {pass_:<17} {name:<15} "
                f"{times[name]:>8.3f} {rates[name]:>8.1f} {ratio:>9.2f}"
            )
    del q, k, v, dout
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
