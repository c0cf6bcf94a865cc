"""The memory ledger: what each path saves for backward, predicted and measured.

Predicted saved bytes come from each strategy's formula (b = bytes per input
element, l = bytes per softmax statistic: 4, or 8 for float64; each query row
keeps two, its max m and log l, its log normalizer)::

    explicit   b*(B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + b*B*Hq*Nq*Nk         q, k, v, P
    recompute  b*(B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + 2*l*B*Hq*Nq          q, k, v, (m, log l)
    flash      b*(B*Hq*Nq*(d + dv) + B*Hkv*Nk*(d + dv)) + 2*l*B*Hq*Nq   q, k, v, O, (m, log l)
    triton     as flash

(recompute and flash also keep the caller's mask, when given, to re-apply it).
Measured saved bytes add up every tensor autograd packs during forward, seen
through `torch.autograd.graph.saved_tensors_hooks`.  Peak memory of
forward+backward is measured on CPU by replaying the allocator's events that
the profiler records (every allocation and free, in order), and on CUDA by the
allocator's own peak counter.  Tables, CSV and plots: `attngrad.report`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.api import attention

__all__ = [
    "BASELINES",
    "Layout",
    "LedgerRow",
    "ledger_row",
    "measure_peak_bytes",
    "measure_saved_bytes",
    "predicted_saved_bytes",
    "run_ledger",
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
    stat = 8 if lo.dtype == torch.float64 else 4
    q = lo.batch * lo.heads_q * lo.seq_q * lo.head_dim
    kv = lo.batch * lo.heads_kv * lo.seq_k * (lo.head_dim + lo.value_dim)
    rows = lo.batch * lo.heads_q * lo.seq_q
    if path == "explicit":
        return b * (q + kv) + b * rows * lo.seq_k
    if path == "recompute":
        return b * (q + kv) + 2 * stat * rows + mask_bytes
    if path in ("flash", "triton"):
        return b * (q + rows * lo.value_dim + kv) + 2 * stat * rows + mask_bytes
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


@dataclass(frozen=True)
class LedgerRow:
    """One path of the ledger at one `Layout` (its sizes copied out); bytes throughout.

    ``peak`` and ``peak_beyond_io`` are None when not measured.
    """

    path: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    value_dim: int
    dtype: str
    causal: bool
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
        batch=layout.batch,
        heads_q=layout.heads_q,
        heads_kv=layout.heads_kv,
        seq_q=layout.seq_q,
        seq_k=layout.seq_k,
        head_dim=layout.head_dim,
        value_dim=layout.value_dim,
        dtype=str(layout.dtype).removeprefix("torch."),
        causal=layout.causal,
        predicted_saved=predicted_saved_bytes(path, layout),
        measured_saved=saved,
        peak=peak_bytes,
        peak_beyond_io=beyond_io,
    )


def run_ledger(
    paths: Sequence[str],
    layouts: Sequence[Layout],
    device: str = "cpu",
    peak: bool = True,
    step: Callable[[str], None] | None = None,
) -> tuple[list[LedgerRow], list[str]]:
    """The rows of every path at every layout, layout by layout, and one note per
    baseline left out: an SDPA backend that rejects the layout raises RuntimeError,
    which becomes a note; a strategy's error propagates.  ``step`` hears each
    (path, layout) pair as it is done."""
    rows: list[LedgerRow] = []
    notes: list[str] = []
    for layout in layouts:
        for path in paths:
            try:
                rows.append(ledger_row(path, layout, device, peak))
            except RuntimeError as e:
                if path not in BASELINES:
                    raise
                notes.append(f"{path}: not available for this layout ({str(e).splitlines()[0]})")
            if step is not None:
                step(f"{path} Nq={layout.seq_q} Nk={layout.seq_k}")
    return rows, notes
