"""The memory ledger: what each path saves for backward, predicted and measured.

Predicted saved bytes come from each strategy's formula (b = bytes per input
element, l = bytes per lse element: 4, or 8 for float64)::

    explicit   b*(B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + b*B*Hq*Nq*Nk       q, k, v, P
    recompute  b*(B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + l*B*Hq*Nq          q, k, v, lse
    flash      b*(B*Hq*Nq*(d + dv) + B*Hkv*Nk*(d + dv)) + l*B*Hq*Nq   q, k, v, O, lse
    triton     as flash

(recompute and flash also keep the caller's mask, when given, to re-apply it).
Measured saved bytes add up every tensor autograd packs during forward, seen
through `torch.autograd.graph.saved_tensors_hooks`.  Peak memory of
forward+backward is measured on CPU by replaying the allocator's events that
the profiler records (every allocation and free, in order), and on CUDA by the
allocator's own peak counter.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.api import attention
from attngrad.contract import DTYPES, positive_int
from attngrad.progress import Progress
from attngrad.strategies import STRATEGIES, available, refuse_unavailable

__all__ = [
    "BASELINES",
    "LedgerRow",
    "measure_peak_bytes",
    "measure_saved_bytes",
    "predicted_saved_bytes",
    "register",
]

BASELINES = {"sdpa-math": SDPBackend.MATH, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


@dataclass(frozen=True)
class Layout:
    """Sizes of one ledger run: q [B, Hq, Nq, d], k [B, Hkv, Nk, d], v [B, Hkv, Nk, dv]."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    causal: bool = False


def predicted_saved_bytes(path: str, layout: Layout, mask_bytes: int = 0) -> int | None:
    """A strategy's saved-bytes formula (module docstring); None for the baselines."""
    lo = layout
    b = torch.finfo(lo.dtype).bits // 8
    lse = 8 if lo.dtype == torch.float64 else 4
    q = lo.batch * lo.heads_q * lo.seq_q * lo.head_dim
    kv = lo.batch * lo.heads_kv * lo.seq_k * (lo.head_dim + lo.value_dim)
    rows = lo.batch * lo.heads_q * lo.seq_q
    if path == "explicit":
        return b * (q + kv) + b * rows * lo.seq_k
    if path == "recompute":
        return b * (q + kv) + lse * rows + mask_bytes
    if path in ("flash", "triton"):
        return b * (q + rows * lo.value_dim + kv) + lse * rows + mask_bytes
    return None


def _inputs(layout: Layout, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    lo = layout

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=lo.dtype)

    q = randn(lo.batch, lo.heads_q, lo.seq_q, lo.head_dim).requires_grad_()
    k = randn(lo.batch, lo.heads_kv, lo.seq_k, lo.head_dim).requires_grad_()
    v = randn(lo.batch, lo.heads_kv, lo.seq_k, lo.value_dim).requires_grad_()
    dout = randn(lo.batch, lo.heads_q, lo.seq_q, lo.value_dim)
    return q, k, v, dout


def path_fn(path: str, layout: Layout) -> Callable[..., torch.Tensor]:
    """q, k, v -> O along one path: a strategy or an SDPA backend."""
    gqa = layout.heads_q != layout.heads_kv
    if path in BASELINES:
        backend = BASELINES[path]

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=layout.causal, enable_gqa=gqa
                )

        return sdpa

    def strategy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, is_causal=layout.causal, enable_gqa=gqa, strategy=path)

    return strategy


def measure_saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of every tensor autograd saves while ``fn`` runs forward, and its output."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ side logs a start and a stop line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak(run: Callable[[], object]) -> int:
    """Peak of live bytes allocated on CPU while ``run`` runs, above the start."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure_peak_bytes(run: Callable[[], object], device: str = "cpu") -> int:
    """Peak bytes allocated by ``run`` beyond what was live before it."""
    if device == "cpu":
        return _cpu_peak(run)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@dataclass
class LedgerRow:
    """One path of the ledger; bytes throughout."""

    path: str
    seq_q: int
    seq_k: int
    predicted_saved: int | None
    measured_saved: int
    peak: int | None
    peak_beyond_io: int | None

    @property
    def match(self) -> bool | None:
        return None if self.predicted_saved is None else self.predicted_saved == self.measured_saved


def ledger_row(path: str, layout: Layout, device: str = "cpu", peak: bool = True) -> LedgerRow:
    """Predict, then measure saved bytes and (optionally) peak memory of one path.

    triton on CPU runs in Triton's interpreter, whose numpy buffers the
    allocator never sees: its peak is left out (None) rather than misreported.
    """
    q, k, v, dout = _inputs(layout, device)
    fn = path_fn(path, layout)
    saved, out = measure_saved_bytes(lambda: fn(q, k, v))
    del out
    peak_bytes = beyond_io = None
    if peak and not (path == "triton" and device == "cpu"):

        def run() -> None:
            o = fn(q, k, v)
            torch.autograd.grad(o, (q, k, v), dout)

        peak_bytes = measure_peak_bytes(run, device)
        io = sum(t.numel() * t.element_size() for t in (dout, q, k, v))  # output + the 3 grads
        beyond_io = max(0, peak_bytes - io)
    return LedgerRow(
        path=path,
        seq_q=layout.seq_q,
        seq_k=layout.seq_k,
        predicted_saved=predicted_saved_bytes(path, layout),
        measured_saved=saved,
        peak=peak_bytes,
        peak_beyond_io=beyond_io,
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f} MiB"


def format_rows(rows: Sequence[LedgerRow]) -> str:
    """The ledger as a text table."""
    head = (
        f"{'path':<11} {'Nq x Nk':>13} {'predicted saved':>17} {'measured saved':>17} "
        f"{'match':>5} {'peak fwd+bwd':>15} {'beyond I/O':>15}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        match = {None: "-", True: "yes", False: "NO"}[r.match]
        lines.append(
            f"{r.path:<11} {f'{r.seq_q} x {r.seq_k}':>13} {_mib(r.predicted_saved):>17} "
            f"{_mib(r.measured_saved):>17} {match:>5} {_mib(r.peak):>15} {_mib(r.peak_beyond_io):>15}"
        )
    return "\n".join(lines)


def write_csv(rows: Sequence[LedgerRow], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), "match"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), "match": r.match})


def plot(rows: Sequence[LedgerRow], path: str, title: str) -> None:
    """Two log-log panels against N, one line per path: saved bytes (predicted as
    hollow markers where a formula exists) and peak bytes of forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("bytes saved for backward", "measured_saved")]
    if all(r.peak is not None for r in rows):
        panels.append(("peak of forward+backward", "peak"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    markers = "osD^vx"
    for ax, (label, field_name) in zip(axes[0], panels, strict=True):
        for i, name in enumerate(dict.fromkeys(r.path for r in rows)):
            mine = [r for r in rows if r.path == name]
            n = [r.seq_q for r in mine]
            # paths that save the same bytes overlap: thinner lines on top keep each visible
            (line,) = ax.plot(
                n,
                [getattr(r, field_name) for r in mine],
                marker=markers[i % len(markers)],
                lw=3.0 - 0.4 * i,
                ms=7 - i,
                label=name,
            )
            predicted = [r.predicted_saved for r in mine if r.predicted_saved is not None]
            if field_name == "measured_saved" and len(predicted) == len(mine):
                ax.plot(
                    n,
                    predicted,
                    ls="none",
                    marker="o",
                    ms=12,
                    mfc="none",
                    color=line.get_color(),
                    alpha=0.5,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sequence length N (Nq = Nk)")
        ax.set_ylabel(label + " (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + "   (hollow circles: predicted by the saved-bytes formulas)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layout(args: argparse.Namespace, seq_q: int, seq_k: int) -> Layout:
    return Layout(
        batch=args.batch,
        heads_q=args.heads,
        heads_kv=args.heads_kv or args.heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=args.head_dim,
        value_dim=args.value_dim or args.head_dim,
        dtype=DTYPES[args.dtype],
        causal=args.causal,
    )


def _row_or_none(path: str, layout: Layout, args: argparse.Namespace) -> LedgerRow | None:
    """The row of one path; None (with a note) where the path cannot run here.

    That is an SDPA backend that rejects the layout.
    """
    try:
        return ledger_row(path, layout, args.device, peak=not args.no_peak)
    except RuntimeError as e:
        if path not in BASELINES:
            raise
        print(f"{path}: not available for this layout ({str(e).splitlines()[0]})", file=sys.stderr)
        return None


def _run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attngrad ledger: error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if refuse_unavailable("ledger", args.path, device):
        return 2
    paths = args.path or [*available(device), *BASELINES]
    sizes = [(n, n) for n in args.sweep] if args.sweep else [(args.seq_q, args.seq_k or args.seq_q)]
    rows: list[LedgerRow] = []
    try:
        with Progress(len(paths) * len(sizes), "ledger") as bar:
            for seq_q, seq_k in sizes:
                for p in paths:
                    row = _row_or_none(p, _layout(args, seq_q, seq_k), args)
                    if row is not None:
                        rows.append(row)
                    bar.step(f"{p} Nq={seq_q} Nk={seq_k}")
    except (ValueError, TypeError) as e:
        print(f"attngrad ledger: error: {e}", file=sys.stderr)
        return 2
    print(format_rows(rows))
    csv_path = args.csv or ("results/ledger.csv" if args.sweep else None)
    if csv_path:
        write_csv(rows, csv_path)
        print(f"wrote {csv_path}")
    plot_path = args.plot or ("results/ledger.png" if args.sweep else None)
    if plot_path:
        title = f"B={args.batch} H={args.heads} d={args.head_dim} {args.dtype}"
        plot(rows, plot_path, title)
        print(f"wrote {plot_path}")
    mismatched = [r for r in rows if r.match is False]
    for r in mismatched:
        print(
            f"MISMATCH {r.path} N={r.seq_q}: predicted {r.predicted_saved} measured {r.measured_saved}"
        )
    return 1 if mismatched else 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``attngrad ledger`` to a subparsers object."""
    p = sub.add_parser(
        "ledger",
        help="saved bytes (predicted vs measured) and peak memory of every path",
        description="What each path saves between forward and backward, predicted from "
        "the strategies' saved-bytes formulas and measured, and the peak memory of "
        "forward+backward, beside SDPA's MATH and FLASH_ATTENTION backends.",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="batch B (default 1)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads Hq (default 8)")
    p.add_argument("--heads-kv", type=positive_int, help="key/value heads Hkv for GQA (default Hq)")
    p.add_argument(
        "--seq-q", type=positive_int, default=1024, help="query length Nq (default 1024)"
    )
    p.add_argument("--seq-k", type=positive_int, help="key length Nk (default Nq)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="q/k head dim d (default 64)")
    p.add_argument("--value-dim", type=positive_int, help="value head dim dv (default d)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="(default float32)")
    p.add_argument("--causal", action="store_true", help="is_causal=True")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--path",
        action="append",
        choices=[*STRATEGIES, *BASELINES],
        help="a strategy or SDPA backend (repeatable; default all)",
    )
    p.add_argument("--no-peak", action="store_true", help="skip the peak-memory runs (faster)")
    p.add_argument(
        "--sweep",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="run over these N (Nq = Nk) instead of --seq-q/--seq-k; writes CSV and PNG",
    )
    p.add_argument(
        "--csv",
        metavar="PATH",
        help="write the rows as CSV (default with --sweep: results/ledger.csv)",
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write the log-log plot (default with --sweep: results/ledger.png)",
    )
    p.set_defaults(run=_run)
