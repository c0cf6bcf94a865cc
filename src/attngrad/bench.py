"""``attngrad bench``: each strategy against SDPA's own backends, side by side.

    attngrad bench [--batch 1 --heads 8 --head-dim 64] [--seq 1024 2048 4096]
                   [--causal {both,yes,no}] [--strategy NAME ...] [--baseline {math,flash} ...]
                   [--dtype float32] [--repeats 5] [--gemm-time 0.2] [--csv PATH] [--plot PATH]

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
  warm-up round first, the median, min and max over ``repeats`` rounds;

* FLOPs (the usual convention): forward ``4·B·H·Nq·Nk·d`` (the two products S = q k^T and
  O = P v, 2 FLOP per multiply-add), half of it with ``is_causal``; backward
  2.5x forward (five products the size of the forward's two: S recomputed,
  dV, dP, dq, dk); so forward+backward is 3.5x forward.  GFLOP/s = FLOPs / median time;

* the machine's matmul rate, measured once at the start by the caller
  (`attngrad.machine.probe`: a square GEMM in the run's dtype, grown until one
  product takes a set time), so ``of GEMM`` (GFLOP/s over that rate) says how
  much of the machine's matmul throughput an attention path turns into
  attention.  Above 100%, attention ran faster than the measured GEMM: the
  calibration's GEMM was too small to reach the BLAS's steady rate;

* ``auto``: the strategy ``attention(strategy="auto")`` picks for the shape
  (`attngrad.strategies.resolve`), on every row;

* ``vs sdpa-math`` (and each other baseline): contender time / baseline time,
  medians of the same run.  Below 1 the contender is faster.

The CPU rule of ``attention(strategy="auto")`` (explicit for short sequences,
flash from a number of scores Nq·Nk on) is read off this command's
``forward+backward`` rows; `crossover` finds the N from which flash beats
explicit, and the command prints it.  Tables, CSV and plots: `attngrad.report`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.api import attention
from attngrad.contract import Shapes
from attngrad.strategies import resolve
from attngrad.timing import Spread, interleaved, spreads

__all__ = [
    "BASELINES",
    "PASSES",
    "BenchRow",
    "auto_choice",
    "baseline_label",
    "crossover",
    "flops",
    "run_bench",
    "steps",
]

Pass = Literal["forward", "backward", "forward+backward"]
PASSES: tuple[Pass, ...] = ("forward", "backward", "forward+backward")

# FLOPs of each pass in units of the forward's 4·B·H·Nq·Nk·d.
_PASS_FACTOR: dict[str, float] = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}

BASELINES: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
}


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


@dataclass(frozen=True)
class BenchRow:
    """One (shape, causal, pass, contender) measurement.

    ``time_s`` is the median over ``repeats`` rounds, ``low_s`` and ``high_s`` the
    fastest and slowest round; ``ratios[baseline]`` = this contender's median / that
    baseline's median, keyed by the baseline's contender name (``"sdpa-math"``);
    ``auto`` is the strategy ``attention(strategy="auto")`` picks for this shape.
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
    low_s: float
    high_s: float
    gemm_gflops: float
    auto: str
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


def auto_choice(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> str:
    """The strategy ``attention(strategy="auto")`` runs for CPU q, k, v: [B, H, N, d]."""
    shapes = Shapes((batch,), heads, heads, seq, seq, head_dim, head_dim)
    return resolve("auto", shapes, tiling_given=False, banded=causal, device=torch.device("cpu"))


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
) -> dict[str, dict[str, Spread]]:
    """Seconds ``{pass: {contender: spread}}``, contenders interleaved within each pass.

    q, k, v: [B, H, N, d] (requires_grad), do: [B, H, N, d].
    """
    result: dict[str, dict[str, Spread]] = {}
    for pass_ in PASSES:
        kept: list[object] = []
        fns = _timed_calls(pass_, contenders, q, k, v, do, causal, kept)
        for fn in fns.values():  # the warm-up round, by hand so its outputs are freed untimed
            fn()
        kept.clear()

        def end_round(r: int, pass_: str = pass_, kept: list[object] = kept) -> None:
            kept.clear()
            step(f"{pass_} round {r + 1}/{repeats}")

        result[pass_] = spreads(interleaved(fns, repeats=repeats, warmup=0, on_round=end_round))
        del fns  # frees the graphs the backward calls held
    return result


def steps(seqs: Sequence[int], causal_modes: Sequence[bool], repeats: int) -> int:
    """How many times `run_bench` calls its ``step``: once per timed round."""
    return len(seqs) * len(causal_modes) * len(PASSES) * repeats


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
    *,
    gemm_gflops: float,
    seed: int = 0,
    step: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Time every contender over ``seqs`` x ``causal_modes`` x `PASSES`.

    q, k, v: [batch, heads, N, head_dim] in ``dtype``, the same for every
    contender.  ``strategies`` are names for ``attention(strategy=...)``
    (``"auto"`` included); ``baselines`` are keys of `BASELINES`;
    ``gemm_gflops`` is the machine's matmul rate in ``dtype``
    (`attngrad.machine.probe`).  Returns one `BenchRow` per (N, causal, pass,
    contender), in that order, each with its ratio against each baseline.
    ``step`` hears a note after each timed round (`steps` of them).
    """
    for name in baselines:
        if name not in BASELINES:
            raise ValueError(f"baseline must be one of {tuple(BASELINES)}, got {name!r}")
    contenders: dict[str, Attention] = {name: _strategy_fn(name) for name in strategies}
    contenders |= {baseline_label(b): _sdpa_fn(BASELINES[b]) for b in baselines}
    dtype_name = str(dtype).removeprefix("torch.")
    rows: list[BenchRow] = []
    generator = torch.Generator().manual_seed(seed)
    for n in seqs:
        shape = (batch, heads, n, head_dim)  # (B, H, N, d)
        q, k, v, do = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for causal in causal_modes:

            def note(text: str, n: int = n, causal: bool = causal) -> None:
                if step is not None:
                    step(f"N={n} causal={'yes' if causal else 'no'} {text}")

            times = _time_passes(contenders, q, k, v, do, causal, repeats, note)
            auto = auto_choice(batch, heads, n, head_dim, causal)
            for pass_, by_name in times.items():
                for name, t in by_name.items():
                    ratios = {
                        baseline_label(b): t.median / by_name[baseline_label(b)].median
                        for b in baselines
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
                            time_s=t.median,
                            low_s=t.low,
                            high_s=t.high,
                            gemm_gflops=gemm_gflops,
                            auto=auto,
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
