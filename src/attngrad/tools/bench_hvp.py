"""``attngrad bench --order 2``: second-order and forward-mode cost, side by side.

Two measurements per (N, causal), on q, k, v: [B, H, N, d]:

* **hvp**, a Hessian-vector product of a scalar loss of the output O, by double
  backward::

      L   = sum(O**2) / 2          (loss "square", the default)  or  <O, dO>  ("dot")
      g   = torch.autograd.grad(L, (q, k, v), create_graph=True)
      hvp = torch.autograd.grad(<g_q, w_q> + <g_k, w_k> + <g_v, w_v>, (q, k, v))

  timed as one call (forward, first backward with its graph, second backward).
  "square" takes the cotangent of O from O itself, so the second backward also
  differentiates the first backward with respect to its dO (and runs a first-order
  backward through O for it): the whole of a real loss's Hessian.  "dot" holds dO
  fixed, random: only attention's own second derivative, contracted with dO.
  Beside its time, the call's ``peak`` memory (`attngrad.tools.memory.measure_peak_bytes`)
  and ``beyond I/O``: the peak less the bytes of O and the three HVP results, which
  the call hands back (as the ledger counts O and the three gradients).

* **jvp** against **forward**: ``torch.func.jvp(attention, (q, k, v), (t_q, t_k,
  t_v))``, which returns O and its tangent, against ``attention(q, k, v)`` alone, both
  on inputs that do not require grad (neither builds an autograd graph); the row
  ``jvp/forward`` is the ratio of their medians.

Contenders: attngrad strategies and ``sdpa-math``, F.scaled_dot_product_attention
under sdpa_kernel(SDPBackend.MATH), the one SDPA backend with a double backward on
CPU.  Within each measurement every contender runs once per round, rounds repeat
(`attngrad.tools.timing.interleaved`, one warm-up round): median, min and max.  ``vs
sdpa-math`` = median / sdpa-math's median (below 1: faster).

A contender whose peak memory (from its peak at the previous N, scaled by N², so at
least 2x too high for the O(N) strategies) would not fit in the memory available is
skipped at that N with a note rather than run out of memory.  Tables, CSV and
plot: `attngrad.cli.bench_hvp`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from attngrad.core.contract import dtype_name
from attngrad.tools.memory import format_bytes, measure_peak_bytes
from attngrad.tools.paths import SDPA_MATH, hessian_vector_product, path_fn
from attngrad.tools.timing import Spread, interleaved, spreads

__all__ = [
    "BASELINE",
    "LOSSES",
    "LOSS_TEXT",
    "MEASURES",
    "Order2Row",
    "available_bytes",
    "hvp",
    "peak_only",
    "run_order2",
    "steps",
]

Loss = Literal["square", "dot"]
LOSSES: tuple[Loss, ...] = ("square", "dot")
MEASURES = ("hvp", "forward", "jvp")
BASELINE = SDPA_MATH  # the one SDPA backend with a double backward on CPU
LOSS_TEXT = {"square": "L = sum(O**2)/2", "dot": "L = <O, dO>, dO fixed"}

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Leave this share of the memory available unplanned: the allocator's slack, the
# profiler's own buffers and whatever else the machine runs.
_MEMORY_MARGIN = 0.8


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (then nothing is skipped)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def hvp(
    fn: Attention,
    inputs: Inputs,
    w: Inputs,
    loss: Loss = "square",
    dout: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The Hessian of ``loss`` (module docstring) at ``inputs`` times the direction ``w``.

    inputs q, k, v (requires_grad) and w: like them; ``dout``: like O, needed for "dot".
    """
    o = fn(*inputs)
    if loss == "square":
        scalar = o.square().sum() / 2
    elif loss == "dot":
        if dout is None:
            raise ValueError("loss 'dot' needs dout, the fixed cotangent of O")
        scalar = (o * dout).sum()
    else:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    g = torch.autograd.grad(scalar, inputs, create_graph=True)
    del o, scalar
    return hessian_vector_product(g, inputs, w)


@dataclass(frozen=True)
class Order2Row:
    """One (N, causal, measure, contender) measurement; seconds and bytes.

    ``measure`` is one of `MEASURES`; ``ratio`` = median / sdpa-math's median in the
    same measure (None without sdpa-math), ``ratio_of_min`` the same of the fastest
    rounds (steadier on a shared machine, where rounds are slowed unevenly);
    ``jvp_over_forward`` (jvp rows only) =
    this contender's jvp median / its forward median.  ``peak`` and
    ``peak_beyond_io``: hvp rows with peaks measured, else None.
    """

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    causal: bool
    loss: str
    repeats: int
    measure: str
    contender: str
    time_s: float
    low_s: float
    high_s: float
    ratio: float | None = None
    ratio_of_min: float | None = None
    jvp_over_forward: float | None = None
    peak: int | None = None
    peak_beyond_io: int | None = None


def steps(seqs: Sequence[int], causal_modes: Sequence[bool], repeats: int) -> int:
    """How many times `run_order2` calls its ``step``: once per timed round (hvp and
    forward/jvp, each ``repeats`` of them)."""
    return len(seqs) * len(causal_modes) * 2 * repeats


def _hvp_peak(fn: Attention, inputs: Inputs, w: Inputs, loss: Loss, dout: torch.Tensor) -> int:
    return measure_peak_bytes(lambda: hvp(fn, inputs, w, loss, dout))


def _io_bytes(inputs: Inputs) -> int:
    """O and the three HVP results: [B, H, N, d] each (dv = d here)."""
    return 4 * inputs[0].numel() * inputs[0].element_size()


def _time(
    fns: dict[str, Attention],
    inputs: Inputs,
    w: Inputs,
    dout: torch.Tensor,
    plain: Inputs,
    tangents: Inputs,
    loss: Loss,
    repeats: int,
    tell: Callable[[str], None],
) -> tuple[dict[str, Spread], dict[str, Spread]]:
    """({contender: hvp spread}, {"forward NAME" / "jvp NAME": spread}): the HVPs
    interleaved, then every forward and jvp interleaved, one warm-up round each."""
    calls: dict[str, Callable[[], object]] = {
        name: partial(hvp, fn, inputs, w, loss, dout) for name, fn in fns.items()
    }
    hvp_times = interleaved(calls, repeats, warmup=1, on_round=lambda r: tell(f"hvp round {r + 1}"))
    del calls
    timed: dict[str, Callable[[], object]] = {}
    for name, fn in fns.items():
        timed[f"forward {name}"] = partial(fn, *plain)
        timed[f"jvp {name}"] = partial(torch.func.jvp, fn, plain, tangents)
    fj = interleaved(
        timed, repeats, warmup=1, on_round=lambda r: tell(f"forward/jvp round {r + 1}")
    )
    return spreads(hvp_times), spreads(fj)


def run_order2(
    seqs: Sequence[int],
    causal_modes: Sequence[bool],
    contenders: Sequence[str],
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    *,
    loss: Loss = "square",
    peak: bool = True,
    memory: int | None = None,
    seed: int = 0,
    step: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> list[Order2Row]:
    """Time (and measure the HVP peak of) every contender over ``seqs`` x ``causal_modes``.

    ``contenders``: names for ``attention(strategy=...)`` and `BASELINE`.  Rows come
    per (N, causal): the hvp rows, then per contender its forward and jvp rows.
    ``memory``: bytes a contender may plan to use (default `available_bytes`);
    skipping one says so to ``note``.  ``step`` hears each timed round.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    dtype_label = dtype_name(dtype)
    generator = torch.Generator().manual_seed(seed)
    rows: list[Order2Row] = []
    previous: dict[tuple[str, bool], tuple[int, int]] = {}  # (name, causal) -> (N, peak)
    for n in seqs:
        shape = (batch, heads, n, head_dim)

        def randn(shape: tuple[int, ...] = shape) -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(dtype)

        plain = (randn(), randn(), randn())
        inputs: Inputs = tuple(t.detach().requires_grad_() for t in plain)  # type: ignore[assignment]
        w: Inputs = (randn(), randn(), randn())
        tangents: Inputs = (randn(), randn(), randn())
        dout = randn()
        for causal in causal_modes:

            def tell(text: str, n: int = n, causal: bool = causal) -> None:
                if step is not None:
                    step(f"N={n} causal={'yes' if causal else 'no'} {text}")

            fns = {name: path_fn(name, causal) for name in contenders}
            budget = memory if memory is not None else available_bytes()
            peaks: dict[str, int] = {}
            for name in list(fns):
                last = previous.get((name, causal))
                if budget is not None and last is not None:
                    expected = last[1] * (n / last[0]) ** 2
                    if expected > _MEMORY_MARGIN * budget:
                        if note is not None:
                            note(
                                f"{name}: skipped at N={n} causal={causal}: its HVP would "
                                f"need about {format_bytes(int(expected))} (its peak at "
                                f"N={last[0]} x (N/{last[0]})²), {format_bytes(budget)} "
                                "available"
                            )
                        del fns[name]
                        continue
                if peak:
                    peaks[name] = _hvp_peak(fns[name], inputs, w, loss, dout)
                    previous[(name, causal)] = (n, peaks[name])
            hvp_times, fj = _time(fns, inputs, w, dout, plain, tangents, loss, repeats, tell)
            base = hvp_times.get(BASELINE)
            io = _io_bytes(inputs)
            where = (batch, heads, n, head_dim, dtype_label, causal, loss, repeats)
            for name, t in hvp_times.items():
                p = peaks.get(name)
                ratio = None if base is None else t.median / base.median
                low = None if base is None else t.low / base.low
                beyond = None if p is None else max(0, p - io)
                rows.append(Order2Row(*where, "hvp", name, t.median, t.low, t.high, ratio, low,
                                      peak=p, peak_beyond_io=beyond))  # fmt: skip
            for name in fns:
                forward = fj[f"forward {name}"]
                for measure in ("forward", "jvp"):
                    t = fj[f"{measure} {name}"]
                    base_t = fj.get(f"{measure} {BASELINE}")
                    ratio = None if base_t is None else t.median / base_t.median
                    low = None if base_t is None else t.low / base_t.low
                    over = t.median / forward.median if measure == "jvp" else None
                    rows.append(Order2Row(*where, measure, name, t.median, t.low, t.high, ratio,
                                          low, jvp_over_forward=over))  # fmt: skip
    return rows


def peak_only(
    seq: int,
    contenders: Sequence[str],
    batch: int = 1,
    heads: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    *,
    causal: bool = False,
    loss: Loss = "square",
    memory: int | None = None,
    estimates: dict[str, int] | None = None,
    seed: int = 0,
    note: Callable[[str], None] | None = None,
) -> dict[str, tuple[int, int] | None]:
    """{contender: (peak, beyond I/O) of one HVP at N=``seq``, or None when skipped}.

    ``estimates``: expected peak bytes per contender; one over the memory available
    (``memory``, default `available_bytes`, times a margin) is skipped and told to
    ``note``.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    q, k, v, dout, *w = (torch.randn(shape, generator=generator).to(dtype) for _ in range(7))
    inputs: Inputs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    budget = memory if memory is not None else available_bytes()
    out: dict[str, tuple[int, int] | None] = {}
    for name in contenders:
        expected = (estimates or {}).get(name)
        if budget is not None and expected is not None and expected > _MEMORY_MARGIN * budget:
            if note is not None:
                note(
                    f"{name}: peak not measured at N={seq}: it would need about "
                    f"{format_bytes(expected)}, {format_bytes(budget)} available"
                )
            out[name] = None
            continue
        p = _hvp_peak(path_fn(name, causal), inputs, (w[0], w[1], w[2]), loss, dout)
        out[name] = (p, max(0, p - _io_bytes(inputs)))
    return out
