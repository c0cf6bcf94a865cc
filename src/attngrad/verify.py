"""The conformance harness: judge an attention implementation against float64.

For one `Case` (shapes, dtype, mask kind) and one strategy it measures the
max error of the output and of every gradient (dq, dk, dv and, for a float
mask, dmask) against `reference_attention` run in float64, and applies the
rule serious kernel projects use:

* float64 — error <= 1e-9 * max(1, max|ref|);
* other dtypes — error <= 2 * (error of `reference_attention` run in the same
  dtype) + floor, the 2x rule.  The floor is ``FLOOR_ULPS`` ulps of
  max(1, max|ref|): one for 16-bit dtypes, whose plain-PyTorch error is many
  ulps; eight for float32, where both errors sit at a few ulps and the order of
  roundings, not the algorithm, decides their max (over 25 seeds of the
  default grid, explicit — the plain path's own ops — needed 2.4 ulps and
  flash, whose base-2 exponent adds one rounding, 4.2).

NaN anywhere fails.  On float64 cases ``gradcheck`` also runs (fast mode: a
random projection of the Jacobian against finite differences).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.autograd.gradcheck import GradcheckError

from attngrad.api import attention
from attngrad.reference import reference_attention

__all__ = [
    "FLOOR_ULPS",
    "GRADIENTS",
    "MASK_KINDS",
    "Case",
    "CaseResult",
    "default_cases",
    "make_inputs",
    "run_case",
    "two_x_bound",
]

MASK_KINDS = ("none", "causal", "bool", "float")
GRADIENTS = ("out", "dq", "dk", "dv", "dmask")
_F64_TOL = 1e-9
FLOOR_ULPS = {torch.float32: 8.0, torch.float16: 1.0, torch.bfloat16: 1.0}


def two_x_bound(baseline_error: float, dtype: torch.dtype, magnitude: float) -> float:
    """The 2x rule's bound: 2 * baseline error + FLOOR_ULPS ulps of max(1, magnitude)."""
    return 2 * baseline_error + FLOOR_ULPS[dtype] * torch.finfo(dtype).eps * max(1.0, magnitude)


@dataclass(frozen=True)
class Case:
    """One conformance case: q [*lead, Hq, Nq, d], k [*lead, Hkv, Nk, d], v [*lead, Hkv, Nk, dv]."""

    lead: tuple[int, ...]
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    mask: str = "none"

    @property
    def id(self) -> str:
        """A readable id built from the shape, e.g. ``B2-H4:2-N33x47-d16:24-float32-causal``."""
        batch = "x".join(map(str, self.lead)) or "1"
        heads = f"{self.heads_q}" + (f":{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        seq = f"{self.seq_q}" + (f"x{self.seq_k}" if self.seq_k != self.seq_q else "")
        dims = f"{self.head_dim}" + (
            f":{self.value_dim}" if self.value_dim != self.head_dim else ""
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return f"B{batch}-H{heads}-N{seq}-d{dims}-{dtype}-{self.mask}"

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv


@dataclass
class CaseResult:
    """Errors and verdicts of one strategy on one case (JSON-ready via `as_dict`)."""

    strategy: str
    case: str
    dtype: str
    errors: dict[str, float] = field(default_factory=dict)
    baseline_errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    rule_passed: bool = False
    gradcheck_passed: bool | None = None
    nan: bool = False
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.rule_passed and not self.nan and self.gradcheck_passed is not False

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def default_cases() -> list[Case]:
    """The grid `attngrad check` runs: every dtype x mask kind x layout.

    Odd sizes on purpose (33, 47, 59) so no tile or vector width divides them.
    """
    layouts = [
        dict(lead=(2,), heads_q=2, heads_kv=2, seq_q=33, seq_k=33, head_dim=16, value_dim=16),
        # GQA with Nq != Nk and a value dim unlike the query/key dim
        dict(lead=(1,), heads_q=4, heads_kv=2, seq_q=17, seq_k=47, head_dim=59, value_dim=24),
        # the course chapter's [B, N, d] layout (no leading dims) and two leading dims
        dict(lead=(), heads_q=3, heads_kv=3, seq_q=97, seq_k=97, head_dim=8, value_dim=8),
        dict(lead=(2, 2), heads_q=2, heads_kv=1, seq_q=7, seq_k=1, head_dim=8, value_dim=8),
    ]
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    return [
        Case(**layout, dtype=dtype, mask=mask)  # type: ignore[arg-type]
        for dtype in dtypes
        for mask in MASK_KINDS
        for layout in layouts
    ]


def _mask(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    """The case's mask in float64 (bool for "bool").

    "bool" is shared across heads ([*lead, 1, Nq, Nk]) and has one query row
    that attends nothing; "float" is shared across the batch ([Hq, Nq, Nk]),
    so its gradient is summed over the broadcast dims.
    """
    if case.mask == "bool":
        keep = torch.rand(*case.lead, 1, case.seq_q, case.seq_k, generator=gen) > 0.3
        keep[..., min(1, case.seq_q - 1), :] = False
        return keep
    if case.mask == "float":
        return torch.randn(case.heads_q, case.seq_q, case.seq_k, generator=gen, dtype=torch.float64)
    return None


def make_inputs(case: Case, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """float64 q, k, v, mask and an upstream gradient dout for the case."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(*case.lead, case.heads_q, case.seq_q, case.head_dim),
        "k": randn(*case.lead, case.heads_kv, case.seq_k, case.head_dim),
        "v": randn(*case.lead, case.heads_kv, case.seq_k, case.value_dim),
        "mask": _mask(case, gen),
        "dout": randn(*case.lead, case.heads_q, case.seq_q, case.value_dim),
    }


AttentionFn = Callable[..., torch.Tensor]


def outputs_and_grads(
    fn: AttentionFn, case: Case, inputs: dict[str, torch.Tensor | None], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Run ``fn`` on the inputs cast to ``dtype``; return out and every gradient in float64."""
    q, k, v = (inputs[n].to(dtype).requires_grad_() for n in "qkv")  # type: ignore[union-attr]
    mask = inputs["mask"]
    leaves = [q, k, v]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype).requires_grad_()
        leaves.append(mask)
    out = fn(q, k, v, mask, is_causal=case.mask == "causal", enable_gqa=case.gqa)
    grads = torch.autograd.grad(out, leaves, inputs["dout"].to(dtype))  # type: ignore[union-attr]
    names = ("dq", "dk", "dv", "dmask")
    return {
        "out": out.detach().double(),
        **{n: g.double() for n, g in zip(names, grads, strict=False)},
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _gradcheck(fn: AttentionFn, case: Case, inputs: dict[str, torch.Tensor | None]) -> bool:
    q, k, v = (inputs[n].clone().requires_grad_() for n in "qkv")  # type: ignore[union-attr]
    mask = inputs["mask"]
    args: list[torch.Tensor] = [q, k, v]
    if mask is not None and mask.dtype != torch.bool:
        args.append(mask.clone().requires_grad_())

    def call(*a: torch.Tensor) -> torch.Tensor:
        m = a[3] if len(a) > 3 else mask
        return fn(a[0], a[1], a[2], m, is_causal=case.mask == "causal", enable_gqa=case.gqa)

    try:
        return bool(torch.autograd.gradcheck(call, tuple(args), fast_mode=True))
    except GradcheckError:
        return False


def strategy_fn(strategy: str) -> AttentionFn:
    """`attention` bound to one strategy."""

    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return attention(*args, strategy=strategy, **kwargs)  # type: ignore[arg-type]

    return fn


def run_case(
    strategy: str, case: Case, seed: int = 0, gradcheck: bool = True, fn: AttentionFn | None = None
) -> CaseResult:
    """Judge one strategy (or any SDPA-like ``fn``) on one case."""
    fn = fn or strategy_fn(strategy)
    inputs = make_inputs(case, seed)
    result = CaseResult(
        strategy=strategy, case=case.id, dtype=str(case.dtype).removeprefix("torch.")
    )
    ref = outputs_and_grads(reference_attention, case, inputs, torch.float64)
    try:
        got = outputs_and_grads(fn, case, inputs, case.dtype)
    except Exception as exc:  # a crash is a failed case, reported with its message
        result.message = f"{type(exc).__name__}: {exc}"
        return result
    base = None
    if case.dtype != torch.float64:
        base = outputs_and_grads(reference_attention, case, inputs, case.dtype)
    passed = True
    for name, r in ref.items():
        magnitude = float(r.abs().max()) if r.numel() else 0.0
        result.nan |= bool(got[name].isnan().any())
        err = _max_err(got[name], r)
        if base is None:
            bound = _F64_TOL * max(1.0, magnitude)
        else:
            result.baseline_errors[name] = _max_err(base[name], r)
            bound = two_x_bound(result.baseline_errors[name], case.dtype, magnitude)
        result.errors[name] = err
        result.bounds[name] = bound
        passed &= err <= bound
    result.rule_passed = passed
    if gradcheck and case.dtype == torch.float64:
        result.gradcheck_passed = _gradcheck(fn, case, inputs)
    return result


def format_error(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1e}"
