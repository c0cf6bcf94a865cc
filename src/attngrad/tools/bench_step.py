"""``attngrad bench``: each strategy against SDPA's own backends, side by side.

For q, k, v: [B, H, N, d] (requires_grad), every N, causal or not, each contender runs
three passes: ``forward`` (building the autograd graph, as training does), ``backward``
alone and ``forward+backward`` as one call.  ``backward`` runs
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` on a graph built once
before timing: every backward here only reads what forward saved, so each call does
the work of the first, whereas forward+backward minus forward would put the noise of
two medians into one small difference (it can come out negative).  Forward outputs
are released between rounds, outside every timed region.

Contenders: the attngrad strategies and ``F.scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.MATH)`` (``sdpa-math``) and ``FLASH_ATTENTION``
(``sdpa-flash``), on the same inputs, interleaved round by round
(`attngrad.tools.timing.interleaved`) after one warm-up round: median, min and max over
``repeats`` rounds.  FLOPs: `flops`.  ``of GEMM`` is GFLOP/s over the machine's matmul
rate in the run's dtype (`attngrad.tools.machine.probe`, measured once by the caller); above
100%, the calibration's GEMM was too small to reach the BLAS's steady rate.  ``auto``
is the strategy ``attention(strategy="auto")`` picks for the shape; ``vs sdpa-math``
is contender time / baseline time (below 1: faster).

The CPU rule of ``strategy="auto"`` (explicit for short sequences, flash from a number
of scores Nq·Nk on) is read off the ``forward+backward`` rows: `crossover` finds the N
from which flash beats explicit.  Tables, CSV and plots: `attngrad.cli.bench`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from attngrad.core.contract import Shapes, dtype_name
from attngrad.strategies import resolve
from attngrad.strategies.fused import build
from attngrad.tools.paths import SDPA_BASELINES, path_fn
from attngrad.tools.timing import PASSES, Spread, interleaved, spreads, timed_pass

__all__ = [
    "PASSES",
    "BenchRow",
    "auto_choice",
    "crossover",
    "estimate_seconds",
    "flops",
    "run_bench",
    "step_flops",
    "steps",
]

# FLOPs of each pass in units of the forward's 4·B·H·Nq·Nk·d.
_PASS_FACTOR: dict[str, float] = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def flops(
    batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, pass_: str
) -> float:
    """FLOPs of one attention pass, by the usual convention; ``heads`` counts query heads.

    forward = 4·B·H·Nq·Nk·d (S = q k^T and O = P v, 2 FLOP per multiply-add), halved
    with ``causal``; backward = 2.5 x forward (five products the size of the forward's
    two: S recomputed, dV, dP, dq, dk); forward+backward = 3.5 x forward.

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
    """The strategy ``attention(strategy="auto")`` runs for CPU q, k, v: [B, H, N, d].

    Without building anything: where fused's kernels are not built yet but can be, "auto"
    would build them at its first call and take fused, and that is the answer.
    """
    if build.loaded_or_built() is None and build.missing_tools() is None:
        return "fused"
    shapes = Shapes((batch,), heads, heads, seq, seq, head_dim, head_dim)
    return resolve("auto", shapes, tiling_given=False, banded=causal, device=torch.device("cpu"))


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _time_passes(
    contenders: dict[str, Attention],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    do: torch.Tensor,
    repeats: int,
    step: Callable[[str], None],
) -> dict[str, dict[str, Spread]]:
    """Seconds ``{pass: {contender: spread}}``, contenders interleaved within each pass."""
    result: dict[str, dict[str, Spread]] = {}
    for pass_ in PASSES:
        kept: list[object] = []
        fns = {name: timed_pass(pass_, fn, inputs, do, kept) for name, fn in contenders.items()}
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


def step_flops(
    seqs: Sequence[int],
    causal_modes: Sequence[bool],
    repeats: int,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
) -> list[float]:
    """The FLOPs of each of `run_bench`'s steps (one timed round of one pass, per contender),
    in the order it takes them: a progress bar's weights."""
    return [
        flops(batch, heads, n, n, head_dim, causal, pass_)
        for n in seqs
        for causal in causal_modes
        for pass_ in PASSES
        for _ in range(repeats)
    ]


# The share of the GEMM rate an attention call reaches, taken over the contenders, passes and
# sizes of a default bench (from 10% for SDPA MATH's backward at N = 4096 to 90% for a fused
# kernel): what `estimate_seconds` divides by, good to a factor of about two
_ESTIMATED_GEMM_FRACTION = 0.3


def estimate_seconds(
    seqs: Sequence[int],
    causal_modes: Sequence[bool],
    contenders: int,
    repeats: int,
    gemm_gflops: float,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
) -> float:
    """Roughly how long `run_bench` takes: every call it makes (the timed rounds, each pass's
    warm-up round and the backward pass's graph, built once) at a share of the GEMM rate."""
    total = 0.0
    for n in seqs:
        for causal in causal_modes:
            for pass_ in PASSES:
                calls = repeats + 1 + (pass_ == "backward")  # + warm-up, + backward's graph
                total += calls * flops(batch, heads, n, n, head_dim, causal, pass_)
    return contenders * total / (_ESTIMATED_GEMM_FRACTION * gemm_gflops * 1e9)


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
    (``"auto"`` included); ``baselines`` are names of
    `attngrad.tools.paths.SDPA_BASELINES` (``"sdpa-math"``);
    ``gemm_gflops`` is the machine's matmul rate in ``dtype``
    (`attngrad.tools.machine.probe`).  Returns one `BenchRow` per (N, causal, pass,
    contender), in that order, each with its ratio against each baseline.
    ``step`` hears a note after each timed round (`steps` of them).
    """
    for name in baselines:
        if name not in SDPA_BASELINES:
            raise ValueError(f"baseline must be one of {SDPA_BASELINES}, got {name!r}")
    names = [*strategies, *baselines]
    dtype_label = dtype_name(dtype)
    rows: list[BenchRow] = []
    generator = torch.Generator().manual_seed(seed)
    for n in seqs:
        shape = (batch, heads, n, head_dim)  # (B, H, N, d)
        q, k, v, do = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
        inputs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
        for causal in causal_modes:

            def note(text: str, n: int = n, causal: bool = causal) -> None:
                if step is not None:
                    step(f"N={n} causal={'yes' if causal else 'no'} {text}")

            contenders = {name: path_fn(name, causal) for name in names}
            times = _time_passes(contenders, inputs, do, repeats, note)
            auto = auto_choice(batch, heads, n, head_dim, causal)
            for pass_, by_name in times.items():
                for name, t in by_name.items():
                    ratios = {b: t.median / by_name[b].median for b in baselines}
                    row = BenchRow(
                        batch=batch, heads=heads, seq_q=n, seq_k=n, head_dim=head_dim,
                        dtype=dtype_label, causal=causal, pass_=pass_, contender=name,
                        repeats=repeats, time_s=t.median, low_s=t.low, high_s=t.high,
                        gemm_gflops=gemm_gflops, auto=auto, ratios=ratios,
                    )  # fmt: skip
                    rows.append(row)
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
