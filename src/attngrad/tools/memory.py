"""Memory as the ledger and the benches measure it: saved tensors and peak bytes.

Saved bytes add up every tensor autograd packs while a call runs, seen through
`torch.autograd.graph.saved_tensors_hooks`.  Peak bytes: on CPU by replaying the
allocator's events that the profiler records (every allocation and free, in
order), on CUDA by the allocator's own peak counter.  `format_bytes` spells a count
of them, in every table and note.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["format_bytes", "measure_peak_bytes", "measure_saved_bytes", "measure_saved_storages"]

T = TypeVar("T")


def measure_saved_bytes(fn: Callable[[], T]) -> tuple[int, T]:
    """Bytes of every tensor autograd saves while ``fn`` runs forward, and its output."""
    total, _, out = measure_saved_storages(fn)
    return total, out


def measure_saved_storages(fn: Callable[[], T]) -> tuple[int, dict[int, int], T]:
    """What autograd saves while ``fn`` runs: the bytes of every pack (as
    `measure_saved_bytes`), {storage address: its bytes} with each storage once however
    many views of it are saved (the memory the graph holds), and ``fn``'s output."""
    total = 0
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, storages, out


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


def format_bytes(n: int | None) -> str:
    """``840 B``, ``1.50 KiB``, ``536.00 MiB``; ``-`` for None.  Exact bytes while small,
    since the small cases are checked by eye."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:,.2f} {unit}"
