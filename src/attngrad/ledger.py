"""The memory ledger: what each path saves for backward, predicted and measured.

Predicted saved bytes come from each strategy's declaration of what it saves
(`attngrad.strategies.base.saved_bytes`; b = bytes per input element, l =
bytes per softmax statistic: 4, or 8 for float64; each query row keeps two,
its max m and log l, its log normalizer)::

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
from attngrad.strategies import MODULES, base
from attngrad.verify import Case

__all__ = [
    "BASELINES",
    "LedgerRow",
    "ledger_row",
    "measure_peak_bytes",
    "measure_saved_bytes",
    "predicted_saved_bytes",
    "run_ledger",
]

BASELINES = {"sdpa-math": SDPBackend.MATH, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


def predicted_saved_bytes(path: str, case: Case, mask_bytes: int = 0) -> int | None:
    """A strategy's declared saved bytes (module docstring); None for the baselines."""
    if path not in MODULES:
        return None
    return base.saved_bytes(MODULES[path], case.shapes, case.dtype, mask_bytes)


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    sh = case.shapes

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=case.dtype)

    q = randn(sh.batch, sh.heads_q, sh.seq_q, sh.head_dim).requires_grad_()
    k = randn(sh.batch, sh.heads_kv, sh.seq_k, sh.head_dim).requires_grad_()
    v = randn(sh.batch, sh.heads_kv, sh.seq_k, sh.value_dim).requires_grad_()
    dout = randn(sh.batch, sh.heads_q, sh.seq_q, sh.value_dim)
    return q, k, v, dout


def path_fn(path: str, causal: bool, gqa: bool = False) -> Callable[..., torch.Tensor]:
    """q, k, v -> O along one path: a strategy or an SDPA backend (a key of `BASELINES`)."""
    if path not in BASELINES:
        return lambda q, k, v: attention(q, k, v, is_causal=causal, enable_gqa=gqa, strategy=path)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(BASELINES[path]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return sdpa


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
    """One path of the ledger at one `Case` (its sizes copied out); bytes throughout.

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


def ledger_row(path: str, case: Case, device: str = "cpu", peak: bool = True) -> LedgerRow:
    """Predict, then measure saved bytes and (optionally) peak memory of one path.

    triton on CPU runs in Triton's interpreter, whose numpy buffers the
    allocator never sees: its peak is left out (None) rather than misreported.
    """
    q, k, v, dout = _inputs(case, device)
    fn = path_fn(path, case.mask == "causal", case.gqa)
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
    sizes = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "value_dim")
    return LedgerRow(
        path=path,
        **{name: getattr(case.shapes, name) for name in sizes},
        dtype=str(case.dtype).removeprefix("torch."),
        causal=case.mask == "causal",
        predicted_saved=predicted_saved_bytes(path, case),
        measured_saved=saved,
        peak=peak_bytes,
        peak_beyond_io=beyond_io,
    )


def run_ledger(
    paths: Sequence[str],
    cases: Sequence[Case],
    device: str = "cpu",
    peak: bool = True,
    step: Callable[[str], None] | None = None,
) -> tuple[list[LedgerRow], list[str]]:
    """The rows of every path at every case, case by case, and one note per
    baseline left out: an SDPA backend that rejects the case raises RuntimeError,
    which becomes a note; a strategy's error propagates.  ``step`` hears each
    (path, case) pair as it is done."""
    rows: list[LedgerRow] = []
    notes: list[str] = []
    for case in cases:
        for path in paths:
            try:
                rows.append(ledger_row(path, case, device, peak))
            except RuntimeError as e:
                if path not in BASELINES:
                    raise
                notes.append(f"{path}: not available for this case ({str(e).splitlines()[0]})")
            if step is not None:
                step(f"{path} Nq={case.shapes.seq_q} Nk={case.shapes.seq_k}")
    return rows, notes
