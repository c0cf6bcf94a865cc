"""The memory ledger: what each path saves for backward, predicted and measured.

Predicted saved bytes come from each strategy's declaration of what it saves
(its ``saves``, added up by `attngrad.strategies.base.saved_bytes`: the one
place the saved-bytes formulas live; the caller's mask counts too where a
strategy keeps it to re-apply it).
Measured saved bytes add up every tensor autograd packs during forward, and the
peak memory of forward+backward is the allocator's (`attngrad.tools.memory`).
Beside the strategies run SDPA's own backends (`attngrad.tools.paths.SDPA_BASELINES`).
Tables, CSV and plots: `attngrad.cli.ledger`.

Second order (`second_order_row`, ``attngrad ledger --order 2``): what a
gradient penalty keeps.  g = grad(O, (q, k, v), dO, create_graph=True) saves
a graph of its own (every strategy's `AttentionGradients` node: dO, q, k, v
and the forward's saved tensors again, by reference), and O's forward graph
stays alive with it until the second backward.  Per path: the bytes packed by
forward and by the ``create_graph`` backward (each pack counted, as above),
what both keep alive together (each storage once: the memory held until the
second backward), and the peak of forward + ``create_graph`` backward + the
Hessian-vector product grad(sum_i <g_i, w_i>, (q, k, v)).  SDPA's CPU flash
kernel has no derivative of its backward: its row says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from attngrad.core.contract import dtype_name
from attngrad.core.interface import saved_bytes
from attngrad.strategies import REGISTRY
from attngrad.tools.memory import measure_peak_bytes, measure_saved_bytes, measure_saved_storages
from attngrad.tools.paths import SDPA_BASELINES, hessian_vector_product, path_fn
from attngrad.verify.cases import Case

__all__ = [
    "LedgerRow",
    "PathAt",
    "SecondOrderRow",
    "ledger_row",
    "predicted_saved_bytes",
    "run_ledger",
    "run_second_order_ledger",
    "second_order_row",
]

T = TypeVar("T")


def predicted_saved_bytes(path: str, case: Case, mask_bytes: int = 0) -> int | None:
    """A strategy's declared saved bytes (its `saves`); None for the baselines."""
    if path not in REGISTRY:
        return None
    return saved_bytes(REGISTRY[path], case.shapes, case.dtype, mask_bytes)


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


@dataclass(frozen=True)
class PathAt:
    """A path at one `Case`, its sizes copied out: the first columns of every ledger row."""

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


_SIZES = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "value_dim")


def _path_at(path: str, case: Case) -> dict[str, Any]:
    """`PathAt`'s fields of ``path`` at ``case``, to build a row from."""
    sizes = {name: getattr(case.shapes, name) for name in _SIZES}
    return {"path": path, **sizes, "dtype": dtype_name(case.dtype), "causal": case.mask == "causal"}


@dataclass(frozen=True)
class LedgerRow(PathAt):
    """One path of the ledger at one `Case`; bytes throughout.

    ``peak`` and ``peak_beyond_io`` are None when not measured.
    """

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
    return LedgerRow(
        **_path_at(path, case),
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
    return _rows(ledger_row, paths, cases, device, peak, step)


def _rows(
    row: Callable[[str, Case, str, bool], T],
    paths: Sequence[str],
    cases: Sequence[Case],
    device: str,
    peak: bool,
    step: Callable[[str], None] | None,
) -> tuple[list[T], list[str]]:
    """``row(path, case, device, peak)`` for every case and path, and the notes of
    `run_ledger`."""
    rows: list[T] = []
    notes: list[str] = []
    for case in cases:
        for path in paths:
            try:
                rows.append(row(path, case, device, peak))
            except RuntimeError as e:
                if path not in SDPA_BASELINES:
                    raise
                notes.append(f"{path}: not available for this case ({str(e).splitlines()[0]})")
            if step is not None:
                step(f"{path} Nq={case.shapes.seq_q} Nk={case.shapes.seq_k}")
    return rows, notes


# ------------------------------------------------------------------- second order


@dataclass(frozen=True)
class SecondOrderRow(PathAt):
    """One path's double-backward memory at one `Case`; bytes throughout.

    ``forward_saved`` / ``backward_saved``: every tensor packed by forward and by the
    ``create_graph=True`` backward; ``kept``: the storages of both, each once (what a
    gradient penalty holds until its second backward); ``peak`` / ``peak_beyond_io``: of
    forward + that backward + a Hessian-vector product (None when not measured).
    ``supported`` False: the path has no double backward (``note`` says why; the
    numbers after ``forward_saved`` are then None).
    """

    supported: bool
    forward_saved: int
    backward_saved: int | None
    kept: int | None
    peak: int | None
    peak_beyond_io: int | None
    note: str = ""


def second_order_row(
    path: str, case: Case, device: str = "cpu", peak: bool = True
) -> SecondOrderRow:
    """Measure what the double-backward graph of one path saves and (optionally) its peak.

    The gradients g = grad(O, (q, k, v), dO, create_graph=True) and one
    Hessian-vector product along w (random, like q, k, v) always run: a path whose
    second backward raises "not implemented" gets ``supported=False``.  triton on
    CPU leaves its peak out, as in `ledger_row`.
    """
    q, k, v, dout = _inputs(case, device)
    gen = torch.Generator(device=device).manual_seed(1)
    w = [torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype) for x in (q, k, v)]
    fn = path_fn(path, case.mask == "causal", case.gqa)
    forward_saved, forward_storages, out = measure_saved_storages(lambda: fn(q, k, v))

    def first(o: torch.Tensor = out) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(o, (q, k, v), dout, create_graph=True)

    backward_saved, backward_storages, grads = measure_saved_storages(first)
    common = {**_path_at(path, case), "forward_saved": forward_saved}
    try:
        hessian_vector_product(grads, (q, k, v), w)
    except RuntimeError as e:
        if "not implemented" not in str(e):
            raise
        first_line = str(e).splitlines()[0]
        return SecondOrderRow(
            **common, supported=False, backward_saved=None, kept=None, peak=None,
            peak_beyond_io=None, note=first_line,
        )  # fmt: skip
    del out, grads
    kept = sum({**forward_storages, **backward_storages}.values())
    peak_bytes = beyond_io = None
    if peak and not (path == "triton" and device == "cpu"):

        def run() -> None:
            o = fn(q, k, v)
            g = torch.autograd.grad(o, (q, k, v), dout, create_graph=True)
            hessian_vector_product(g, (q, k, v), w)

        peak_bytes = measure_peak_bytes(run, device)
        # the output, the 3 gradients and the 3 products: O is dO's size
        io = sum(t.numel() * t.element_size() for t in (dout, q, k, v, q, k, v))
        beyond_io = max(0, peak_bytes - io)
    return SecondOrderRow(
        **common, supported=True, backward_saved=backward_saved, kept=kept, peak=peak_bytes,
        peak_beyond_io=beyond_io,
    )  # fmt: skip


def run_second_order_ledger(
    paths: Sequence[str],
    cases: Sequence[Case],
    device: str = "cpu",
    peak: bool = True,
    step: Callable[[str], None] | None = None,
) -> tuple[list[SecondOrderRow], list[str]]:
    """`second_order_row` of every path at every case, and notes, as `run_ledger`."""
    return _rows(second_order_row, paths, cases, device, peak, step)
