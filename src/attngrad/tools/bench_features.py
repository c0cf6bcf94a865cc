"""``attngrad bench --features``: what each of attention's features costs, as a ratio.

For q, k, v: [B, H, N, d] (requires_grad), each strategy times forward+backward (O,
then dq, dk, dv in one call, `attngrad.tools.timing.timed_pass`'s ``forward+backward``; the sinks'
own gradient is not asked for) of six variants of the same call::

    none     attention(q, k, v)
    dropout  attention(q, k, v, dropout_p=0.1)
    softcap  attention(q, k, v, softcap=50.0)
    sinks    attention(q, k, v, sinks=s)                  s: [H], one logit per head
    causal   attention(q, k, v, is_causal=True)
    packed   attention(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
             cu = torch.arange(0, N + 1, N // 8): 8 causal segments of N / 8

Every strategy and variant runs once per round, rounds repeat
(`attngrad.tools.timing.interleaved`, one warm-up round), all in one run per N, so the
machine's noise falls on all of them alike.  A feature's ``ratio`` is its variant's fastest round over its
baseline's fastest round (`FEATURES`: dropout, softcap and sinks against ``none``,
packed against ``causal``); the ratio of the medians is kept beside it.  Two ratios
have targets, for flash at N = 4096 (`TARGET_SEQ`): dropout <= 1.15 and packed <= 0.25
(8 segments of N/8 hold 1/8 of the causal scores).  Tables, CSV and plot:
`attngrad.cli.bench_features`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from attngrad.api import attention
from attngrad.core.contract import dtype_name
from attngrad.tools.timing import Spread, interleaved, spreads, timed_pass

__all__ = [
    "DROPOUT_P",
    "FEATURES",
    "SEGMENTS",
    "SOFTCAP",
    "TARGET_SEQ",
    "TARGET_STRATEGY",
    "Feature",
    "FeatureRow",
    "feature_calls",
    "run_features",
    "segment_bounds",
    "steps",
    "targets",
    "validate_seqs",
]

DROPOUT_P = 0.1
SOFTCAP = 50.0
SEGMENTS = 8
TARGET_STRATEGY = "flash"
TARGET_SEQ = 4096
CPU = torch.device("cpu")

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Feature:
    """A feature, the variant it is timed against, and its target ratio (None: none)."""

    name: str
    about: str
    baseline: str
    target: float | None = None


FEATURES: tuple[Feature, ...] = (
    Feature("dropout", f"dropout_p={DROPOUT_P} vs none", "none", 1.15),
    Feature(
        "packed",
        f"{SEGMENTS} causal segments of N/{SEGMENTS} (cu_seqlens_q = cu_seqlens_k) vs one "
        "causal sequence of N",
        "causal",
        0.25,
    ),
    Feature("softcap", f"softcap={SOFTCAP} vs none", "none"),
    Feature("sinks", "sinks [H] (one logit per head) vs none", "none"),
)


@dataclass(frozen=True)
class FeatureRow:
    """One (N, feature, strategy) measurement, seconds of forward+backward.

    ``low_s`` / ``median_s``: the feature's variant, fastest and median round;
    ``base_low_s`` / ``base_median_s``: the same of its baseline variant.
    """

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    device: str
    repeats: int
    feature: str
    baseline: str
    strategy: str
    low_s: float
    median_s: float
    base_low_s: float
    base_median_s: float
    target: float | None

    @property
    def ratio(self) -> float:
        """Fastest round over the baseline's fastest round (below 1: the feature is faster)."""
        return self.low_s / self.base_low_s

    @property
    def median_ratio(self) -> float:
        """The same of the medians."""
        return self.median_s / self.base_median_s

    @property
    def met(self) -> bool | None:
        """Whether ``ratio`` meets the target; None without one."""
        return None if self.target is None else self.ratio <= self.target


def segment_bounds(n: int, device: torch.device | None = None) -> torch.Tensor:
    """cu_seqlens of `SEGMENTS` equal segments of ``n``: ``[0, n/8, 2n/8, ..., n]``."""
    validate_seqs([n])
    return torch.arange(0, n + 1, n // SEGMENTS, device=device)


def validate_seqs(seqs: Sequence[int]) -> None:
    """ValueError unless every N splits into `SEGMENTS` equal packed segments."""
    wrong = [n for n in seqs if n % SEGMENTS]
    if wrong:
        raise ValueError(
            f"every N must be a multiple of {SEGMENTS} (the packed variant splits it into "
            f"{SEGMENTS} equal segments), got {wrong[0]}; e.g. --seq {SEGMENTS * 512}"
        )


def _variants(
    n: int, heads: int, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, dict[str, object]]:
    """{variant: the keywords of its ``attention`` call} (module docstring)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    sinks = torch.randn(heads, generator=generator, device=device).to(dtype)
    cu = segment_bounds(n, device)
    return {
        "none": {},
        "dropout": {"dropout_p": DROPOUT_P, "generator": generator},
        "softcap": {"softcap": SOFTCAP},
        "sinks": {"sinks": sinks},
        "causal": {"is_causal": True},
        "packed": {"is_causal": True, "cu_seqlens_q": cu, "cu_seqlens_k": cu},
    }


def feature_calls(
    strategy: str,
    n: int,
    heads: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    seed: int = 0,
) -> dict[str, Attention]:
    """{variant: q, k, v -> O} for q, k, v: [B, ``heads``, ``n``, d] along ``strategy``.

    The dropout variant draws a fresh mask each call from its own generator (seeded
    with ``seed``, as are the sinks).
    """
    return {
        name: partial(attention, strategy=strategy, **keywords)
        for name, keywords in _variants(n, heads, dtype, device, seed).items()
    }


def _forward_backward(
    fn: Attention, inputs: Inputs, do: torch.Tensor, device: torch.device
) -> Callable[[], object]:
    """One call of the forward+backward pass (`attngrad.tools.timing.timed_pass`), on
    CUDA waiting for the device at its end so a timer around it sees the work."""
    call = timed_pass("forward+backward", fn, inputs, do, [])
    if device.type != "cuda":
        return call

    def synced() -> None:
        call()
        torch.cuda.synchronize(device)

    return synced


def steps(seqs: Sequence[int], repeats: int) -> int:
    """How many times `run_features` calls its ``step``: once per timed round."""
    return len(seqs) * repeats


Where = tuple[int, int, int, int, str, str, int]  # B, H, N, d, dtype, device, repeats


def _rows(times: dict[str, Spread], strategies: Sequence[str], where: Where) -> list[FeatureRow]:
    """One `FeatureRow` per (strategy, feature) from ``{"STRATEGY VARIANT": spread}``."""
    rows = []
    for strategy in strategies:
        for f in FEATURES:
            t, base = times[f"{strategy} {f.name}"], times[f"{strategy} {f.baseline}"]
            target = f.target if strategy == TARGET_STRATEGY else None
            rows.append(FeatureRow(*where, f.name, f.baseline, strategy, t.low, t.median,
                                   base.low, base.median, target))  # fmt: skip
    return rows


def run_features(
    seqs: Sequence[int],
    strategies: Sequence[str] = (TARGET_STRATEGY,),
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    *,
    device: torch.device = CPU,
    seed: int = 0,
    step: Callable[[str], None] | None = None,
) -> list[FeatureRow]:
    """Time every variant of every strategy at each N of ``seqs``, all interleaved.

    q, k, v: [batch, heads, N, head_dim] in ``dtype`` on ``device`` (default CPU), the
    same for every call.  Returns per N, per strategy, one `FeatureRow` per feature of
    `FEATURES`, in that order; ``target`` is set on `TARGET_STRATEGY`'s rows.  ``step``
    hears a note after each timed round (`steps` of them).
    """
    validate_seqs(seqs)
    generator = torch.Generator().manual_seed(seed)
    rows: list[FeatureRow] = []
    for n in seqs:
        shape = (batch, heads, n, head_dim)  # (B, H, N, d)
        q, k, v, do = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(4))
        inputs: Inputs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
        calls = {
            f"{strategy} {variant}": _forward_backward(fn, inputs, do, device)
            for strategy in strategies
            for variant, fn in feature_calls(strategy, n, heads, dtype, device, seed).items()
        }

        def end_round(r: int, n: int = n) -> None:
            if step is not None:
                step(f"N={n} round {r + 1}/{repeats}")

        times = spreads(interleaved(calls, repeats=repeats, warmup=1, on_round=end_round))
        dtype_label = dtype_name(dtype)
        where = (batch, heads, n, head_dim, dtype_label, str(device), repeats)
        rows += _rows(times, strategies, where)
    return rows


def targets(rows: Sequence[FeatureRow]) -> list[tuple[Feature, FeatureRow | None]]:
    """Each feature with a target and `TARGET_STRATEGY`'s row at `TARGET_SEQ` (None when
    that was not measured)."""
    found = {r.feature: r for r in rows if (r.strategy, r.seq) == (TARGET_STRATEGY, TARGET_SEQ)}
    return [(f, found.get(f.name)) for f in FEATURES if f.target is not None]
