"""Second-order and forward-mode cost of attngrad's strategies against SDPA's MATH backend.

    python benchmarks/benchmark_hvp.py [--seq 1024 2048 4096 8192] [--causal no|yes|both]
                                       [--strategy flash ...] [--repeats 3] [--loss square|dot]
                                       [--target-seq 16384] [--csv results/benchmark_hvp.csv]
                                       [--plot results/benchmark_hvp.png]

What is timed (`attngrad.tools.bench_hvp`): a Hessian-vector product by double backward, L =
sum(O**2)/2 by default (``--loss dot``: <O, dO> for a fixed dO), g = grad(L, (q, k, v),
create_graph=True), hvp = grad(<g, w>, (q, k, v)), with its peak memory; and
torch.func.jvp of attention against its forward alone.  B=1, H=8, d=64, float32 by
default; every contender interleaved round by round, under the machine line
(`attngrad.tools.machine.probe`), whose columns every CSV row carries too.

Then the peak of one HVP at B=1, H=1, N=``--target-seq`` for flash and sdpa-math
(sdpa-math only when its peak, scaled from the sweep by H·N², fits in memory), and
the two targets: flash's HVP time <= 1.0x sdpa-math's at N=2048, and flash's HVP
peak beyond I/O <= 256 MiB at B=1, H=1, N=16384.  Nothing here asserts them.
"""

from __future__ import annotations

import argparse
import sys

import torch

from attngrad.cli.bench_hvp import order2_plot, order2_records, order2_table
from attngrad.cli.table import write_csv
from attngrad.tools import bench_hvp
from attngrad.tools.machine import probe
from attngrad.tools.memory import format_bytes

CAUSAL = {"no": [False], "yes": [True], "both": [False, True]}
TIME_TARGET = (2048, 1.0)  # N, flash / sdpa-math
PEAK_TARGET = 256 * 2**20  # bytes beyond I/O at B=1, H=1, N=16384


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", choices=tuple(CAUSAL), default="both")
    parser.add_argument("--strategy", action="append", help="default: flash, explicit, recompute")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loss", choices=bench_hvp.LOSSES, default="square")
    parser.add_argument("--no-peak", action="store_true", help="skip the sweep's peak runs")
    parser.add_argument(
        "--target-seq", type=int, default=16384, help="N of the B=1 H=1 peak runs (0: skip)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default torch's); 1 keeps a shared machine's noise down",
    )
    parser.add_argument("--csv", default="results/benchmark_hvp.csv")
    parser.add_argument("--plot", default="results/benchmark_hvp.png")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    strategies = args.strategy or ["flash", "explicit", "recompute"]
    contenders = [*strategies, bench_hvp.BASELINE]
    machine = probe(torch.float32)
    print(machine.line(), flush=True)
    rows = bench_hvp.run_order2(
        args.seq, CAUSAL[args.causal], contenders, args.batch, args.heads, args.head_dim,
        repeats=args.repeats, loss=args.loss, peak=not args.no_peak, step=_note, note=_note,
    )  # fmt: skip
    print(order2_table(rows, machine))

    print("\ntargets (reported, not asserted):")
    n_t, ratio_t = TIME_TARGET
    for r in rows:
        if (r.measure, r.contender, r.seq) == ("hvp", "flash", n_t) and r.ratio is not None:
            verdict = "met" if r.ratio <= ratio_t else "MISSED"
            print(
                f"  flash HVP / sdpa-math HVP at N={n_t} causal={'yes' if r.causal else 'no'}: "
                f"{r.ratio:.2f} (target <= {ratio_t}): {verdict}"
            )
    if args.target_seq:
        n = args.target_seq
        estimates: dict[str, int] = {}
        for r in rows:  # scale each contender's largest measured peak by H·N²
            if r.measure == "hvp" and r.peak is not None and not r.causal:
                estimates[r.contender] = int(r.peak * n * n / (r.heads * r.batch * r.seq**2))
        targets = [c for c in ("flash", bench_hvp.BASELINE) if c in contenders]
        peaks = bench_hvp.peak_only(n, targets, loss=args.loss, estimates=estimates, note=_note)
        for name, got in peaks.items():
            if got is None:
                print(f"  {name} HVP peak at B=1 H=1 N={n}: not measured (would not fit)")
                continue
            peak, beyond = got
            line = f"  {name} HVP peak at B=1 H=1 N={n}: {format_bytes(peak)}, "
            line += f"beyond I/O {format_bytes(beyond)}"
            if name == "flash":
                verdict = "met" if beyond <= PEAK_TARGET else "MISSED"
                line += f" (target <= {format_bytes(PEAK_TARGET)}): {verdict}"
            print(line)
            rows.append(
                bench_hvp.Order2Row(
                    batch=1,
                    heads=1,
                    seq=n,
                    head_dim=args.head_dim,
                    dtype="float32",
                    causal=False,
                    loss=args.loss,
                    measure="peak",
                    contender=name,
                    repeats=0,
                    time_s=float("nan"),
                    low_s=float("nan"),
                    high_s=float("nan"),
                    peak=peak,
                    peak_beyond_io=beyond,
                )
            )
    sys.stdout.flush()

    if args.csv:
        write_csv(order2_records(rows), args.csv, machine)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            order2_plot([r for r in rows if r.measure != "peak"], args.plot, machine)
            print(f"wrote {args.plot}")
        except ModuleNotFoundError as e:
            print(f"skipped the plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
