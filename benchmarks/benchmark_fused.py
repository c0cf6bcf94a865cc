"""Strategy "fused" against SDPA's FLASH_ATTENTION kernel and flash, on CPU: the targets.

    python benchmarks/benchmark_fused.py [--repeats 5] [--csv results/benchmark_fused.csv]
    python benchmarks/benchmark_fused.py --products          # the tile products' engines
    python benchmarks/benchmark_fused.py --sweep [--plot docs/fused.png]   # GFLOP/s vs N
    python benchmarks/benchmark_fused.py --auto              # explicit / flash / fused crossover

Every row is a ratio of medians measured in this one process, the contenders
interleaved round by round (`attngrad.tools.timing.interleaved`), under a line
naming the machine, the ceiling of its tile products and its float32 FMA peak
(`attngrad.tools.machine`); fused's GFLOP/s is printed as a fraction of that peak:

* reference shape, B=1 H=8 N=4096 d=64 float32, forward+backward: <= 0.7 x
  sdpa-flash on AVX-512, <= 0.85 on AVX2 (where ATen's products already run near
  the peak), and >= 75% of the FMA peak, at d=64 and at d=128;
* is_causal <= 0.8, its GFLOP/s (half the FLOPs) >= 90% of non-causal's; forward
  alone <= 0.85; long context, B=1 H=1 N=16384, <= 0.6; B=4 H=16 N=1024 d=128
  <= 0.85; bfloat16 inputs against SDPA in bfloat16 (reported); dropout p=0.1
  against no dropout (<= 1.10);
* memory: saved bytes of fused and flash (equal), and fused's peak beyond
  inputs and outputs at B=1 H=1 N=32768 (<= 64 MiB).

``--products`` times each engine of the tile products (brgemm, the micro-kernel,
the BLAS through ATen) per tile shape, one thread.  ``--sweep`` writes GFLOP/s
against N for explicit, flash, fused and sdpa-flash (the plot of docs/fused.md).
``--auto`` times explicit, flash and fused from N = 16 on, the measurement behind
`attngrad.strategies.AUTO_FUSED_SCORES`.
"""

from __future__ import annotations

import argparse
import textwrap

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngrad
from attngrad.cli.table import figure, write_csv
from attngrad.strategies.fused import build
from attngrad.tools.bench_step import flops
from attngrad.tools.machine import BUSY, BUSY_NOTE, probe
from attngrad.tools.memory import format_bytes, measure_peak_bytes, measure_saved_bytes
from attngrad.tools.timing import interleaved, medians


def sdpa_flash(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def strategy(name):
    return lambda q, k, v, **kw: attngrad.attention(q, k, v, strategy=name, **kw)


def inputs(b, h, n, d=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(b, h, n, d, generator=g).to(dtype)


def step(fn, tensors, backward=True, **kw):
    q, k, v, do = tensors
    if backward:
        return lambda: torch.autograd.grad(fn(q, k, v, **kw), (q, k, v), do)

    def forward():
        with torch.no_grad():
            fn(q, k, v, **kw)

    return forward


# fused / SDPA FLASH fwd+bwd at the reference shape: where ATen's products already run near
# the FMA peak (AVX2) fused can win only between them; on AVX-512 by more
REFERENCE_GOAL = {"AVX512": 0.7}
PEAK_GOAL = 0.75  # fused's fwd+bwd GFLOP/s as a fraction of the FMA peak, d=64 and d=128
CAUSAL_GOAL = 0.9  # causal GFLOP/s (half the FLOPs) over non-causal's


def targets(repeats):
    """(label, contender time, baseline time, goal, contender FLOPs) per timed target, one run."""
    ref, ref128, long, wide, bf16 = (
        inputs(1, 8, 4096),
        inputs(1, 8, 4096, d=128),
        inputs(1, 1, 16384),
        inputs(4, 16, 1024, d=128),
        inputs(1, 8, 4096, dtype=torch.bfloat16),
    )
    fused, flash = strategy("fused"), strategy("flash")
    work = {
        "reference": flops(1, 8, 4096, 4096, 64, False, "forward+backward"),
        "d128": flops(1, 8, 4096, 4096, 128, False, "forward+backward"),
        "causal": flops(1, 8, 4096, 4096, 64, True, "forward+backward"),
        "forward": flops(1, 8, 4096, 4096, 64, False, "forward"),
        "long": flops(1, 1, 16384, 16384, 64, False, "forward+backward"),
        "wide": flops(4, 16, 1024, 1024, 128, False, "forward+backward"),
    }
    goal = REFERENCE_GOAL.get(build.capability(), 0.85)
    pairs = {
        "reference fwd+bwd": (step(fused, ref), step(sdpa_flash, ref), goal, work["reference"]),
        "reference fwd+bwd d=128": (
            step(fused, ref128), step(sdpa_flash, ref128), None, work["d128"]
        ),
        "reference fwd+bwd causal": (
            step(fused, ref, is_causal=True),
            step(sdpa_flash, ref, is_causal=True),
            0.8,
            work["causal"],
        ),
        "reference forward": (
            step(fused, ref, False), step(sdpa_flash, ref, False), 0.85, work["forward"]
        ),
        "flash fwd+bwd (for scale)": (step(flash, ref), step(sdpa_flash, ref), None, None),
        "long context B1 H1 N16384": (step(fused, long), step(sdpa_flash, long), 0.6, work["long"]),
        "B4 H16 N1024 d=128": (step(fused, wide), step(sdpa_flash, wide), 0.85, work["wide"]),
        "bfloat16 fwd+bwd": (step(fused, bf16), step(sdpa_flash, bf16), None, None),
        "dropout 0.1 vs none": (step(fused, ref, dropout_p=0.1), step(fused, ref), 1.10, None),
    }  # fmt: skip
    fns = {}
    for label, (a, b, _, _) in pairs.items():
        fns[label + "/a"], fns[label + "/b"] = a, b
    times = medians(interleaved(fns, repeats=repeats))
    return [
        (label, times[label + "/a"], times[label + "/b"], t, w)
        for label, (_, _, t, w) in pairs.items()
    ]


def peak_rows(rows, machine):
    """(label, measured, goal) for the fractions of the FMA peak and causal's rate."""
    rate = {label: w / a / 1e9 for label, a, _, _, w in rows if w is not None}
    out = []
    if machine.fma_gflops:
        for label in ("reference fwd+bwd", "reference fwd+bwd d=128"):
            out.append((f"{label}: of FMA peak", rate[label] / machine.fma_gflops, PEAK_GOAL))
    causal = rate["reference fwd+bwd causal"] / rate["reference fwd+bwd"]
    out.append(("causal GFLOP/s / non-causal's", causal, CAUSAL_GOAL))
    return out


def memory():
    """(saved bytes of fused, of flash, fused's peak beyond inputs and outputs) at B1 H1 N32768."""
    q, k, v, do = inputs(1, 1, 32768)
    saved = {}
    for name in ("fused", "flash"):
        saved[name], _ = measure_saved_bytes(
            lambda name=name: attngrad.attention(q, k, v, strategy=name)
        )
    out = attngrad.attention(q, k, v, strategy="fused")
    grads = torch.autograd.grad(out, (q, k, v), do)  # warm: the outputs exist once already
    del grads
    # peak beyond the inputs: minus the outputs the call must make (O, then dq, dk, dv)
    peak = measure_peak_bytes(
        lambda: torch.autograd.grad(attngrad.attention(q, k, v, strategy="fused"), (q, k, v), do)
    )
    outputs = 4 * q.numel() * 4
    return saved["fused"], saved["flash"], peak - outputs


def products():
    print("GFLOP/s, one thread, C[M, N] += A[M, K] B[K, N] (the tile products of fused)")
    print(f"{'M x N x K':>16} " + " ".join(f"{e:>8}" for e in build.ENGINES))
    for bq, bk in ((64, 128), (128, 256), (256, 512)):
        for shape in build.tile_shapes(bq, bk, 64):
            rates = []
            for e in build.ENGINES:
                try:
                    rates.append(f"{build.product_rate(e, shape):8.1f}")
                except RuntimeError:
                    rates.append(f"{'-':>8}")
            print(f"{'x'.join(map(str, shape)):>16} " + " ".join(rates))


def sweep(repeats, plot, csv):
    machine = probe(torch.float32)
    print(machine.line())
    seqs = (256, 512, 1024, 2048, 4096)
    contenders = {
        "explicit": strategy("explicit"),
        "flash": strategy("flash"),
        "fused": strategy("fused"),
        "sdpa-flash": sdpa_flash,
    }
    records = []
    for causal in (False, True):
        for n in seqs:
            t = inputs(1, 8, n)
            times = medians(
                interleaved(
                    {c: step(fn, t, is_causal=causal) for c, fn in contenders.items()},
                    repeats=repeats,
                )
            )
            work = flops(1, 8, n, n, 64, causal, "forward+backward")
            for c, s in times.items():
                records.append(
                    {
                        "seq": n,
                        "causal": causal,
                        "contender": c,
                        "median_ms": f"{s * 1e3:.4g}",
                        "gflops": f"{work / s / 1e9:.4g}",
                        "of_ceiling": f"{work / s / 1e9 / machine.ceiling_gflops:.3f}",
                        "of_peak": machine.of_peak(work / s / 1e9),
                        "ratio_vs_sdpa_flash": f"{s / times['sdpa-flash']:.3f}",
                    }
                )
            print(
                f"N={n} causal={causal}: "
                + ", ".join(
                    f"{c} {work / s / 1e9:.0f} GFLOP/s, {machine.of_peak(work / s / 1e9)} of peak "
                    f"({s / times['sdpa-flash']:.2f})"
                    for c, s in times.items()
                )
            )
    write_csv(records, csv, machine)
    if plot:
        with figure(plot, 10, 4) as fig:
            axes = fig.subplots(1, 2, sharey=True)
            for ax, causal in zip(axes, (False, True), strict=True):
                for c in contenders:
                    pts = [
                        (r["seq"], float(r["gflops"]))
                        for r in records
                        if r["causal"] == causal and r["contender"] == c
                    ]
                    ax.plot(
                        *zip(*pts, strict=True),
                        "--" if c == "sdpa-flash" else "-",
                        marker="o",
                        label=c,
                    )
                ax.axhline(
                    machine.ceiling_gflops,
                    color="grey",
                    linestyle=":",
                    label="tile products' ceiling",
                )
                if machine.fma_gflops:
                    ax.axhline(machine.fma_gflops, color="black", linestyle="--", label="FMA peak")
                ax.set_xscale("log", base=2)
                ax.set_xticks(seqs, labels=[str(n) for n in seqs])
                ax.minorticks_off()
                ax.set_title(f"forward+backward, causal={'yes' if causal else 'no'}")
                ax.set_xlabel("N")
            axes[0].set_ylabel("GFLOP/s")
            axes[0].legend(fontsize="small")
            fig.suptitle(f"B=1 H=8 d=64 float32\n{textwrap.fill(machine.line(), 100)}")
        print(f"wrote {plot}")


def auto(repeats):
    for causal in (False, True):
        for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
            t = inputs(1, 8, n)
            times = medians(
                interleaved(
                    {
                        s: step(strategy(s), t, is_causal=causal)
                        for s in ("explicit", "flash", "fused")
                    },
                    repeats=repeats,
                )
            )
            best = min(times, key=times.__getitem__)
            print(
                f"N={n:5d} causal={causal!s:5}: "
                + ", ".join(f"{s} {v * 1e3:.2f} ms" for s, v in times.items())
                + f" -> {best}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--products", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--auto", action="store_true")
    parser.add_argument("--plot", default="results/benchmark_fused.png")
    parser.add_argument("--csv", default="results/benchmark_fused.csv")
    args = parser.parse_args()
    library = build.load()
    if args.products:
        return products()
    if args.sweep:
        return sweep(args.repeats, args.plot, args.csv)
    if args.auto:
        return auto(args.repeats)
    machine = probe(torch.float32)
    print(machine.line())
    print(
        f"tile products: {library.engine}; ratios are medians of {args.repeats} interleaved rounds"
    )
    records = []
    rows = targets(args.repeats)
    for label, a, b, target, work in rows:
        verdict = (
            ""
            if target is None
            else f"target <= {target}: {'met' if a / b <= target else 'NOT met'}"
        )
        rate = "" if work is None else f"  fused {work / a / 1e9:6.1f} GFLOP/s"
        of_peak = "" if work is None else f" ({machine.of_peak(work / a / 1e9)} of peak)"
        print(
            f"  {label:<28} {a * 1e3:9.1f} ms / {b * 1e3:9.1f} ms = {a / b:.3f}"
            f"{rate}{of_peak}  {verdict}"
        )
        records.append(
            {
                "target": label,
                "median_ms": f"{a * 1e3:.4g}",
                "baseline_ms": f"{b * 1e3:.4g}",
                "ratio": f"{a / b:.4f}",
                "gflops": "" if work is None else f"{work / a / 1e9:.4g}",
                "goal": "" if target is None else f"<= {target}",
            }
        )
    for label, value, goal in peak_rows(rows, machine):
        # a fraction of the peak above 1: the peak was probed while the machine was busy
        met = (
            "unreliable (busy*)"
            if "of FMA peak" in label and value > 1
            else ("met" if value >= goal else "NOT met")
        )
        print(f"  {label:<46} {value:.3f}  target >= {goal}: {met}")
        records.append({"target": label, "ratio": f"{value:.4f}", "goal": f">= {goal}"})
    if any(machine.of_peak(w / a / 1e9) == BUSY for _, a, _, _, w in rows if w is not None):
        print(BUSY_NOTE)
    fused_saved, flash_saved, peak = memory()
    print(
        f"  saved bytes, B1 H1 N32768: fused {format_bytes(fused_saved)}, flash {format_bytes(flash_saved)}"
    )
    print(
        f"  fused's peak beyond inputs and outputs, B1 H1 N32768 fwd+bwd: {format_bytes(peak)} (target <= 64 MiB)"
    )
    write_csv(records, args.csv, machine)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
