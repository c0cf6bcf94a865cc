"""``attngrad bench``: each strategy against SDPA's own backends, side by side.

    attngrad bench [--batch 1 --heads 8 --head-dim 64] [--seq 1024 2048 4096]
                   [--causal {both,yes,no}] [--strategy NAME ...] [--baseline {math,flash} ...]
                   [--dtype float32] [--repeats 5] [--gemm-size 2048] [--csv PATH] [--plot PATH]

What is measured, for q, k, v: [B, H, N, d] (requires_grad) and every N, causal or not:

* three passes per contender:

  - ``forward``: the forward that builds the autograd graph, as training runs it
    (not under ``torch.no_grad``);
  - ``backward``: backward alone.  The graph is built once before timing and each
    timed call runs ``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` on
    it: every strategy's backward, and SDPA's, only reads what forward saved, so
    each call does the work of the first.  Subtracting the forward median from the
    forward+backward median would instead put the noise of two medians into one
    small difference (it can come out negative);
  - ``forward+backward``: both, timed as one call; the saved tensors are freed
    by backward inside the timed region, as in training.

  Outputs of the forward pass are released between rounds, outside every timed
  region, so no contender pays for freeing another's (or its own previous) graph.

* contenders: the attngrad strategies and ``F.scaled_dot_product_attention`` under
  ``sdpa_kernel(SDPBackend.MATH)`` (``sdpa-math``) and
  ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` (``sdpa-flash``), all on the same
  inputs, interleaved round by round (`attngrad.timing.interleaved`), one
  warm-up round first, medians over ``repeats`` rounds;

* FLOPs (the usual convention): forward ``4·B·H·Nq·Nk·d`` (the two products S = q k^T and
  O = P v, 2 FLOP per multiply-add), half of it with ``is_causal``; backward
  2.5x forward (five products the size of the forward's two: S recomputed,
  dV, dP, dq, dk); so forward+backward is 3.5x forward.  GFLOP/s = FLOPs / median time;

* the machine's matmul rate, measured once at the start: a square
  ``size x size @ size x size`` GEMM (2·size³ FLOP) in the run's dtype.  A large
  square product is where the BLAS reaches its steady rate, so ``of GEMM``
  (GFLOP/s over that rate) says how much of the machine's matmul throughput an
  attention path turns into attention;

* ``vs sdpa-math`` (and each other baseline): contender time / baseline time,
  medians of the same run.  Below 1 the contender is faster.

The CPU rule of ``attention(strategy="auto")`` (`attngrad.strategies.resolve`:
explicit for short sequences, flash from a number of scores Nq·Nk on) is read
off this command's ``forward+backward`` rows; `crossover` finds the N from
which flash beats explicit, and the command prints it.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.api import attention
from attngrad.contract import DTYPES, positive_int
from attngrad.progress import Progress
from attngrad.strategies import STRATEGIES, available, refuse_unavailable
from attngrad.timing import interleaved, medians

__all__ = [
    "BASELINES",
    "CSV_COLUMNS",
    "PASSES",
    "BenchRow",
    "crossover",
    "flops",
    "format_table",
    "gemm_rate",
    "plot",
    "register",
    "run_bench",
    "write_csv",
]

Pass = Literal["forward", "backward", "forward+backward"]
PASSES: tuple[Pass, ...] = ("forward", "backward", "forward+backward")

# FLOPs of each pass in units of the forward's 4·B·H·Nq·Nk·d.
_PASS_FACTOR: dict[str, float] = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}

BASELINES: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
}


# 2048³: 17 GFLOP, a fraction of a second on a few cores, and large enough for
# the BLAS to reach its steady rate (blocking overheads fade well before that).
GEMM_SIZE = 2048


def baseline_label(name: str) -> str:
    """``"math"`` -> ``"sdpa-math"``: the contender name of an SDPA backend."""
    return f"sdpa-{name}"


def flops(
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    causal: bool,
    pass_: str,
) -> float:
    """FLOPs of one attention pass: forward 4·B·H·Nq·Nk·d (half if causal), backward 2.5x.

    forward = 4·B·H·Nq·Nk·d (S = q k^T and O = P v, 2·Nq·Nk·d each), halved
    with ``causal``; backward = 2.5 x forward; forward+backward = 3.5 x forward.
    ``heads`` counts query heads.

    >>> flops(1, 8, 4096, 4096, 64, False, "forward") / 1e9
    34.359738368
    """
    if pass_ not in _PASS_FACTOR:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    forward = 4.0 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        forward /= 2
    return forward * _PASS_FACTOR[pass_]


def gemm_rate(dtype: torch.dtype = torch.float32, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """The machine's matmul rate in ``dtype``, GFLOP/s: the best of two shapes.

    A square ``[size, size] @ [size, size]`` product (2·size³ FLOP) and a
    batched attention tile, 8 x ``[size/16, 64] @ [64, size/2]`` (the q k^T of
    one flash tile at the defaults), each timed ``repeats`` times after a
    warm-up into a preallocated output.  The fastest repeat of the faster
    shape counts: a rate the machine demonstrably reaches, so that a noisy
    moment in this measurement cannot make "of GEMM" exceed 100% by much.
    """
    rows, cols = max(1, size // 16), max(1, size // 2)
    operands = {
        "square": (torch.randn(size, size), torch.randn(size, size)),
        "tile": (torch.randn(8, rows, 64), torch.randn(8, 64, cols)),
    }
    fns = {}
    flops = {}
    for name, (a, b) in operands.items():
        a, b = a.to(dtype), b.to(dtype)
        out = torch.matmul(a, b)
        fns[name] = lambda a=a, b=b, out=out: torch.matmul(a, b, out=out)
        flops[name] = (
            2.0
            * a.shape[-2]
            * a.shape[-1]
            * b.shape[-1]
            * (a.numel() // a.shape[-2] // a.shape[-1])
        )
    times = interleaved(fns, repeats=repeats, warmup=1)
    return max(flops[name] / min(ts) / 1e9 for name, ts in times.items())


@dataclass(frozen=True)
class BenchRow:
    """One (shape, causal, pass, contender) measurement.

    ``ratios[baseline]`` = this contender's median / that baseline's median,
    keyed by the baseline's contender name (``"sdpa-math"``).
    """

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    causal: bool
    pass_: str
    contender: str
    repeats: int
    time_s: float
    gemm_gflops: float
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def gflops(self) -> float:
        """FLOPs of this pass (`flops`) over the median time, in GFLOP/s."""
        n = flops(
            self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim, self.causal, self.pass_
        )
        return n / self.time_s / 1e9

    @property
    def gemm_fraction(self) -> float:
        """GFLOP/s over the machine's measured GEMM rate (same dtype)."""
        return self.gflops / self.gemm_gflops


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _strategy_fn(name: str) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return attention(q, k, v, is_causal=causal, strategy=name)

    return run


def _sdpa_fn(backend: SDPBackend) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _timed_calls(
    pass_: str,
    contenders: dict[str, Attention],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    kept: list[object],
) -> dict[str, Callable[[], object]]:
    """One no-argument call per contender that runs ``pass_`` once.

    q, k, v: [B, H, N, d] (requires_grad), do: [B, H, N, d].  Forward outputs
    go to ``kept``, for the caller to free outside the timed region.
    """
    inputs = (q, k, v)
    if pass_ == "forward":

        def forward(fn: Attention) -> Callable[[], object]:
            return lambda: kept.append(fn(q, k, v, causal))

        return {name: forward(fn) for name, fn in contenders.items()}
    if pass_ == "backward":

        def backward(o: torch.Tensor) -> Callable[[], object]:
            # the graph of o is built here, untimed, and reused by every call
            return lambda: torch.autograd.grad(o, inputs, do, retain_graph=True)

        return {name: backward(fn(q, k, v, causal)) for name, fn in contenders.items()}

    def forward_backward(fn: Attention) -> Callable[[], object]:
        return lambda: torch.autograd.grad(fn(q, k, v, causal), inputs, do)

    return {name: forward_backward(fn) for name, fn in contenders.items()}


def _time_passes(
    contenders: dict[str, Attention],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    repeats: int,
    step: Callable[[str], None],
) -> dict[str, dict[str, float]]:
    """Median seconds ``{pass: {contender: t}}``, contenders interleaved within each pass.

    q, k, v: [B, H, N, d] (requires_grad), do: [B, H, N, d].
    """
    result: dict[str, dict[str, float]] = {}
    for pass_ in PASSES:
        kept: list[object] = []
        fns = _timed_calls(pass_, contenders, q, k, v, do, causal, kept)
        for fn in fns.values():  # the warm-up round, by hand so its outputs are freed untimed
            fn()
        kept.clear()

        def end_round(r: int, pass_: str = pass_, kept: list[object] = kept) -> None:
            kept.clear()
            step(f"{pass_} round {r + 1}/{repeats}")

        result[pass_] = medians(interleaved(fns, repeats=repeats, warmup=0, on_round=end_round))
        del fns  # frees the graphs the backward calls held
    return result


def run_bench(
    seqs: Sequence[int],
    causal_modes: Sequence[bool],
    strategies: Sequence[str],
    baselines: Sequence[str],
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    progress: bool = True,
    *,
    gemm_size: int = GEMM_SIZE,
    seed: int = 0,
    stream: TextIO | None = None,
) -> list[BenchRow]:
    """Time every contender over ``seqs`` x ``causal_modes`` x `PASSES`.

    q, k, v: [batch, heads, N, head_dim] in ``dtype``, the same for every
    contender.  ``strategies`` are names for ``attention(strategy=...)``
    (``"auto"`` included); ``baselines`` are keys of `BASELINES`.  Returns one
    `BenchRow` per (N, causal, pass, contender), in that order; every row
    carries its ratio against each baseline and the GEMM rate measured first.
    The progress bar goes to ``stream`` (stderr by default).
    """
    for name in baselines:
        if name not in BASELINES:
            raise ValueError(f"baseline must be one of {tuple(BASELINES)}, got {name!r}")
    contenders: dict[str, Attention] = {name: _strategy_fn(name) for name in strategies}
    contenders |= {baseline_label(b): _sdpa_fn(BASELINES[b]) for b in baselines}
    dtype_name = str(dtype).removeprefix("torch.")
    rounds = len(seqs) * len(causal_modes) * len(PASSES) * repeats
    rows: list[BenchRow] = []
    bar_stream = stream if progress else io.StringIO()
    with Progress(rounds + 1, "bench", stream=bar_stream) as bar:
        gemm = gemm_rate(dtype, gemm_size)
        bar.step(f"GEMM {gemm:.1f} GFLOP/s")
        generator = torch.Generator().manual_seed(seed)
        for n in seqs:
            shape = (batch, heads, n, head_dim)  # (B, H, N, d)
            q, k, v, do = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            for causal in causal_modes:

                def step(note: str, n: int = n, causal: bool = causal) -> None:
                    bar.step(f"N={n} causal={'yes' if causal else 'no'} {note}")

                times = _time_passes(contenders, q, k, v, do, causal, repeats, step)
                for pass_, by_name in times.items():
                    for name, t in by_name.items():
                        ratios = {
                            baseline_label(b): t / by_name[baseline_label(b)] for b in baselines
                        }
                        rows.append(
                            BenchRow(
                                batch=batch,
                                heads=heads,
                                seq_q=n,
                                seq_k=n,
                                head_dim=head_dim,
                                dtype=dtype_name,
                                causal=causal,
                                pass_=pass_,
                                contender=name,
                                repeats=repeats,
                                time_s=t,
                                gemm_gflops=gemm,
                                ratios=ratios,
                            )
                        )
    return rows


def crossover(
    rows: Iterable[BenchRow],
    fast: str = "flash",
    slow: str = "explicit",
    pass_: str = "forward+backward",
    causal: bool = False,
) -> int | None:
    """The smallest measured N from which ``fast`` beats ``slow`` at every larger N.

    None when ``fast`` is not faster at the largest N (or either is missing).
    """
    times: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.pass_ == pass_ and r.causal == causal and r.contender in (fast, slow):
            times.setdefault(r.seq_q, {})[r.contender] = r.time_s
    seqs = sorted(n for n, t in times.items() if len(t) == 2)
    found: int | None = None
    for n in reversed(seqs):
        if times[n][fast] >= times[n][slow]:
            break
        found = n
    return found


def _baselines_of(rows: Sequence[BenchRow]) -> list[str]:
    return list(rows[0].ratios) if rows else []


CSV_COLUMNS = (
    "batch",
    "heads",
    "seq_q",
    "seq_k",
    "head_dim",
    "dtype",
    "causal",
    "pass",
    "contender",
    "repeats",
    "median_ms",
    "gflops",
    "gemm_gflops",
    "gemm_fraction",
)
"""The fixed CSV columns; a ``ratio_vs_<baseline>`` column per baseline follows."""


def _csv_record(r: BenchRow) -> dict[str, object]:
    record: dict[str, object] = {
        "batch": r.batch,
        "heads": r.heads,
        "seq_q": r.seq_q,
        "seq_k": r.seq_k,
        "head_dim": r.head_dim,
        "dtype": r.dtype,
        "causal": r.causal,
        "pass": r.pass_,
        "contender": r.contender,
        "repeats": r.repeats,
        "median_ms": f"{r.time_s * 1e3:.6g}",
        "gflops": f"{r.gflops:.6g}",
        "gemm_gflops": f"{r.gemm_gflops:.6g}",
        "gemm_fraction": f"{r.gemm_fraction:.6g}",
    }
    for b, ratio in r.ratios.items():
        record[_ratio_column(b)] = f"{ratio:.6g}"
    return record


def _ratio_column(baseline: str) -> str:
    """``"sdpa-math"`` -> ``"ratio_vs_sdpa_math"``."""
    return "ratio_vs_" + baseline.replace("-", "_")


def write_csv(rows: Sequence[BenchRow], path: str | os.PathLike[str]) -> None:
    """One CSV line per `BenchRow`: `CSV_COLUMNS`, then ``ratio_vs_<baseline>`` columns."""
    columns = [*CSV_COLUMNS, *(_ratio_column(b) for b in _baselines_of(rows))]
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(_csv_record(r) for r in rows)


def format_table(rows: Sequence[BenchRow]) -> str:
    """The rows as a text table, one block per (N, causal), a blank line between passes."""
    if not rows:
        return "(no measurements)"
    first = rows[0]
    baselines = _baselines_of(rows)
    lines = [
        f"B={first.batch} H={first.heads} d={first.head_dim} {first.dtype}, "
        f"median of {first.repeats} (after 1 warm-up), GEMM {first.gemm_gflops:.1f} GFLOP/s",
        "vs <baseline> = time / baseline time (below 1: faster)",
    ]
    header = f"{'pass':<17}{'contender':<12}{'time ms':>10}{'GFLOP/s':>9}{'of GEMM':>9}" + "".join(
        f"{'vs ' + b:>16}" for b in baselines
    )
    block: tuple[int, bool] | None = None
    pass_: str | None = None
    for r in rows:
        if (r.seq_q, r.causal) != block:
            block, pass_ = (r.seq_q, r.causal), None
            lines += ["", f"N={r.seq_q} causal={'yes' if r.causal else 'no'}", header]
        elif r.pass_ != pass_:
            lines.append("")
        pass_ = r.pass_
        lines.append(
            f"{r.pass_:<17}{r.contender:<12}{r.time_s * 1e3:>10.2f}{r.gflops:>9.1f}"
            f"{r.gemm_fraction:>9.1%}" + "".join(f"{r.ratios[b]:>16.2f}" for b in baselines)
        )
    return "\n".join(lines)


def plot(rows: Sequence[BenchRow], path: str | os.PathLike[str]) -> None:
    """A PNG: GFLOP/s against N, one panel per (causal, pass), the GEMM rate dashed.

    Raises ModuleNotFoundError naming the fix when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ModuleNotFoundError(
            "matplotlib is not installed; install it with `pip install 'attngrad[plot]'`"
        ) from e
    if not rows:
        raise ValueError("plot needs at least one BenchRow, got none")
    causal_modes = sorted({r.causal for r in rows})
    contenders = list(dict.fromkeys(r.contender for r in rows))
    seqs = sorted({r.seq_q for r in rows})
    fig = Figure(figsize=(4.5 * len(PASSES), 3.5 * len(causal_modes)), layout="constrained")
    axes: Any = fig.subplots(len(causal_modes), len(PASSES), squeeze=False, sharey=True)
    for i, causal in enumerate(causal_modes):
        for j, pass_ in enumerate(PASSES):
            ax = axes[i][j]
            for name in contenders:
                pts = sorted(
                    (r.seq_q, r.gflops)
                    for r in rows
                    if r.causal == causal and r.pass_ == pass_ and r.contender == name
                )
                style = "--" if name.startswith("sdpa-") else "-"
                ax.plot([n for n, _ in pts], [g for _, g in pts], style, marker="o", label=name)
            ax.axhline(rows[0].gemm_gflops, color="grey", linestyle=":", label="GEMM rate")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs, labels=[str(n) for n in seqs])
            ax.minorticks_off()
            ax.set_title(f"{pass_}, causal={'yes' if causal else 'no'}")
            ax.set_xlabel("N")
            if j == 0:
                ax.set_ylabel("GFLOP/s")
    axes[0][0].legend(fontsize="small")
    r = rows[0]
    fig.suptitle(f"attngrad bench: B={r.batch} H={r.heads} d={r.head_dim} {r.dtype}")
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


# ---------------------------------------------------------------------- CLI


def _run(args: argparse.Namespace) -> int:
    cpu = torch.device("cpu")
    if refuse_unavailable("bench", args.strategy, cpu):
        return 2
    strategies = list(dict.fromkeys(args.strategy or available(cpu)))
    baselines = list(dict.fromkeys(args.baseline or BASELINES))
    causal_modes = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    rows = run_bench(
        args.seq,
        causal_modes,
        strategies,
        baselines,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=DTYPES[args.dtype],
        repeats=args.repeats,
        gemm_size=args.gemm_size,
    )
    print(format_table(rows))
    if "flash" in strategies and "explicit" in strategies:
        print()
        for causal in causal_modes:
            n = crossover(rows, causal=causal)
            where = f"from N={n}" if n is not None else "at no measured N"
            print(
                f"forward+backward, causal={'yes' if causal else 'no'}: "
                f"flash is faster than explicit {where}"
            )
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
        except ModuleNotFoundError as e:
            print(f"skipped the plot: {e}", file=sys.stderr)
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``parser.add_subparsers()``; returns its parser."""
    bench = subparsers.add_parser(
        "bench",
        help="time each strategy against SDPA's MATH and FLASH_ATTENTION backends",
        description=(
            "Forward, backward and forward+backward time of each strategy against "
            "F.scaled_dot_product_attention under sdpa_kernel(MATH / FLASH_ATTENTION), "
            "interleaved in one process: GFLOP/s, fraction of the measured GEMM rate, "
            "ratio to each baseline."
        ),
    )
    bench.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    bench.add_argument("--heads", type=positive_int, default=8, help="H (default 8)")
    bench.add_argument("--head-dim", type=positive_int, default=64, help="d (default 64)")
    bench.add_argument(
        "--seq",
        type=positive_int,
        nargs="+",
        default=[1024, 2048, 4096],
        metavar="N",
        help="sequence lengths, Nq = Nk = N (default 1024 2048 4096)",
    )
    bench.add_argument(
        "--causal",
        choices=("both", "yes", "no"),
        default="both",
        help="is_causal runs (default both)",
    )
    bench.add_argument(
        "--strategy",
        action="append",
        choices=(*STRATEGIES, "auto"),
        help="time only this strategy (repeatable; default every one that runs on CPU)",
    )
    bench.add_argument(
        "--baseline",
        action="append",
        choices=tuple(BASELINES),
        help="SDPA backend to compare with (repeatable; default math and flash)",
    )
    bench.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    bench.add_argument(
        "--repeats", type=positive_int, default=5, help="timed rounds, after 1 warm-up (default 5)"
    )
    bench.add_argument(
        "--gemm-size",
        type=positive_int,
        default=GEMM_SIZE,
        help=f"size of the GEMMs that measure the matmul rate (default {GEMM_SIZE})",
    )
    bench.add_argument(
        "--csv",
        default="results/bench.csv",
        metavar="PATH",
        help="write the rows here ('' to skip; default results/bench.csv)",
    )
    bench.add_argument(
        "--plot",
        default="results/bench.png",
        metavar="PATH",
        help="write a PNG plot here ('' to skip; default results/bench.png)",
    )
    bench.set_defaults(run=_run)
    return bench
