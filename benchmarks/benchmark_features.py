"""What dropout, packed segments, softcap and sinks cost in forward+backward, as ratios.

    python benchmarks/benchmark_features.py [--seq 4096] [--strategy flash ...] [--repeats 5]
                                            [--threads 1] [--device cpu|cuda]
                                            [--csv results/benchmark_features.csv]
                                            [--plot results/benchmark_features.png]

The measurement of ``attngrad bench --features`` (`attngrad.tools.bench_features`): per
strategy, forward+backward (O, then dq, dk, dv) of attention with dropout_p=0.1, with 8
causal packed segments of N/8, with softcap=50 and with per-head sinks, each over the
same call without the feature (the packed one over one causal sequence of N), every
call interleaved round by round, ratios of the fastest rounds.  B=1, H=8, d=64, float32
by default, under the machine line (`attngrad.tools.machine.probe`), whose columns every CSV
row carries too.

The two targets, for flash at N=4096: dropout <= 1.15x, packed <= 0.25x.  Exit 1 when
one is missed, or was not measured (flash or N=4096 not in the run).
"""

from __future__ import annotations

import argparse
import sys

import torch

from attngrad.cli.bench_features import features_plot, features_records, features_table
from attngrad.cli.table import write_csv
from attngrad.tools import bench_features
from attngrad.tools.machine import probe


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _verdicts(rows: list[bench_features.FeatureRow]) -> bool:
    """Print each target's ratio and verdict; True when every one was measured and met."""
    print(
        f"\ntargets ({bench_features.TARGET_STRATEGY} at N={bench_features.TARGET_SEQ}, "
        "ratio of the fastest rounds):"
    )
    met = True
    for f, row in bench_features.targets(rows):
        if row is None:
            print(f"  {f.name}: not measured (target <= {f.target}): MISSED")
            met = False
            continue
        verdict = "met" if row.met else "MISSED"
        print(
            f"  {f.name} ({f.about}): {row.ratio:.3f} (median {row.median_ratio:.3f}; "
            f"target <= {f.target}): {verdict}"
        )
        met = met and bool(row.met)
    return met


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[bench_features.TARGET_SEQ])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--strategy", action="append", help="default: flash")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default torch's); 1 keeps a shared machine's noise down",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--csv", default="results/benchmark_features.csv")
    parser.add_argument("--plot", default="results/benchmark_features.png")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = probe(torch.float32, device)
    print(machine.line(), flush=True)
    rows = bench_features.run_features(
        args.seq, args.strategy or [bench_features.TARGET_STRATEGY], args.batch, args.heads,
        args.head_dim, repeats=args.repeats, device=device, step=_note,
    )  # fmt: skip
    print(features_table(rows, machine))
    met = _verdicts(rows)
    sys.stdout.flush()

    if args.csv:
        write_csv(features_records(rows), args.csv, machine)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            features_plot(rows, args.plot, machine)
            print(f"wrote {args.plot}")
        except ModuleNotFoundError as e:
            print(f"skipped the plot: {e}", file=sys.stderr)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
