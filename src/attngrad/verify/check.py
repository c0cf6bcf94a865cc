r"""The conformance harness: judge an attention implementation against float64.

For one `Case` and one strategy (or any SDPA-like function), `run_case`
computes the output and every gradient (dq, dk, dv and, for a float mask,
dmask, for sinks, dsinks), compares each with
`attngrad.verify.reference.reference_attention` run in float64, and
judges the difference with one rule, the same for every dtype and every
machine.  The cases, their inputs and the grid live in
`attngrad.verify.cases`, the rule in `attngrad.verify.rule`, the
higher derivatives (double backward, forward mode) and the gradchecks in
`attngrad.verify.derivatives`; this module runs them and collects a
`CaseResult`.  What a case's strategies are judged against (`expect_case`,
the "expectation" of the glossary, docs/glossary.md) is computed once per
case and seed and handed to each.

NaN anywhere fails.  On float64 cases ``gradcheck`` also runs (fast mode: a
random projection of the Jacobian against finite differences), the higher
derivatives are compared with the reference's, and ``gradgradcheck`` (fast
mode, finite differences of the first-order backward, dout included) runs on
float64 cases of at most ``GRADGRADCHECK_ELEMENTS`` input elements, unless
gradcheck is off (and not on triton, whose interpreter makes it slow:
``SLOW_GRADGRADCHECK``).

A flex case runs ``attngrad.flex_attention`` on the strategy.  A strategy
that declines the case's call -- one whose kernels cannot run it: fused and
triton cannot call a Python score function -- is not failed: its result is
*refused*, with the strategy's own reason (its ``refuses``, `refusal`), and
counts neither way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from attngrad.api import attention, flex_attention
from attngrad.call.flex import FlexCall
from attngrad.core.contract import dtype_name
from attngrad.strategies import REGISTRY
from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    call_case,
    call_flex,
    make_inputs,
    make_leaves,
    outputs_and_grads,
)
from attngrad.verify.derivatives import (
    DERIVATIVE_TOLERANCE,
    derivative_errors,
    gradcheck_passes,
    gradgradcheck_passes,
    leaf_elements,
)
from attngrad.verify.rule import Expected, expect, judge_run

__all__ = [
    "GRADGRADCHECK_ELEMENTS",
    "SLOW_GRADGRADCHECK",
    "CaseResult",
    "expect_case",
    "flex_strategy_fn",
    "format_error",
    "refusal",
    "run_case",
    "strategy_fn",
]

# gradgradcheck's float64 cases: q, k, v, dout and a float mask together at most this many
# elements (every case of the default grid: fast mode costs a few backward passes each)
GRADGRADCHECK_ELEMENTS = 100_000
# strategies whose gradgradcheck `run_case` leaves out unless asked: on CPU tensors triton runs
# in Triton's interpreter, where one takes ~15 s (the check's 16 float64 cases: 4 minutes)
SLOW_GRADGRADCHECK = frozenset({"triton"})


@dataclass
class CaseResult:
    """Errors and verdicts of one strategy on one case (JSON-ready via `as_dict`).

    refused: why the strategy declines the case (`refusal`), None when it ran;
    a refused result has passed False and failed False, and ``"passed": null``
    in `as_dict`.
    """

    strategy: str
    case: str
    dtype: str
    errors: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    baseline_errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    rule_passed: bool = False
    gradcheck_passed: bool | None = None
    nan: bool = False
    message: str = ""
    # float64 cases: relative errors of double backward and forward mode (None: not run)
    second_order_error: float | None = None
    jvp_error: float | None = None
    gradgradcheck_passed: bool | None = None
    refused: str | None = None

    @property
    def derivatives_passed(self) -> bool | None:
        """Both higher-derivative errors within `DERIVATIVE_TOLERANCE`; None when not run."""
        errors = [e for e in (self.second_order_error, self.jvp_error) if e is not None]
        return all(e <= DERIVATIVE_TOLERANCE for e in errors) if errors else None

    @property
    def passed(self) -> bool:
        return (
            self.refused is None
            and self.rule_passed
            and not self.nan
            and self.gradcheck_passed is not False
            and self.derivatives_passed is not False
            and self.gradgradcheck_passed is not False
        )

    @property
    def failed(self) -> bool:
        """Ran and did not pass (a refused case did not run)."""
        return self.refused is None and not self.passed

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": None if self.refused is not None else self.passed}


def strategy_fn(strategy: str, **options: object) -> AttentionFn:
    """`attention` bound to one strategy and any of its keywords (tiles, ``return_lse``)."""

    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return attention(*args, strategy=strategy, **options, **kwargs)  # type: ignore[arg-type,call-overload,no-any-return]

    return fn


def flex_strategy_fn(strategy: str, **options: object) -> AttentionFn:
    """`flex_attention` bound to one strategy and any of its keywords (``return_lse``)."""

    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return flex_attention(*args, strategy=strategy, **options, **kwargs)  # type: ignore[arg-type,no-any-return]

    return fn


def refusal(strategy: str, case: Case, inputs: Inputs) -> str | None:
    """Why ``strategy`` declines the case's call, in its own words (its ``refuses``), or None.

    Only a flex case is declined (by a strategy whose kernels cannot call its
    score function or read its BlockMask); a name that is no strategy (an
    external function) never is.
    """
    if case.flex is None or strategy not in REGISTRY:
        return None

    # the call's mods, as "explicit" takes them: a tensor-op strategy takes every call and
    # needs no build ("auto" would compile fused's kernels to pick a strategy)
    def build(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> FlexCall:
        return FlexCall.build(
            q, k, v, kw.get("score_mod"), kw.get("block_mask"), kw.get("scale"),  # type: ignore[arg-type]
            bool(kw.get("enable_gqa", False)), False, None, None, "explicit",
        )  # fmt: skip

    leaves = {n: t.to(case.dtype) for n, t in make_leaves(inputs, case.dtype).items()}
    call: FlexCall = call_flex(build, case, inputs, leaves)  # type: ignore[arg-type,assignment]
    return REGISTRY[strategy].refuses(call.problem.mods)


def _lse(lse: AttentionFn, case: Case, inputs: Inputs) -> torch.Tensor:
    """The lse ``lse`` (attention called with return_lse=True) gives on the case's inputs."""
    leaves = make_leaves(inputs, case.dtype, dtypes=case.input_dtypes(case.dtype))
    with torch.no_grad():
        _, got = call_case(lse, case, inputs, leaves)  # type: ignore[misc]
    assert isinstance(got, torch.Tensor), "return_lse=True gives (out, lse)"
    return got


def expect_case(case: Case, seed: int = 0) -> Expected:
    """`expect` on the case's inputs drawn from ``seed`` (`make_inputs`): what every
    strategy run on them by `run_case` is judged against; compute it once per case
    and seed and hand it to each."""
    return expect(case, make_inputs(case, seed))


def run_case(
    strategy: str,
    case: Case,
    seed: int = 0,
    gradcheck: bool = True,
    fn: AttentionFn | None = None,
    derivatives: bool = True,
    gradgradcheck: bool | None = None,
    lse: AttentionFn | None = None,
    expected: Expected | None = None,
) -> CaseResult:
    """Judge one strategy (or any SDPA-like ``fn``; flex_attention-like for a flex case) on
    one case.  A strategy that declines the case (`refusal`) comes back refused, unrun.

    A strategy's lse (``return_lse=True``) is judged too (`lse_floor`); with
    ``fn``, the lse of ``lse`` (an ``fn`` that returns (out, lse)) if given.
    expected: `expect_case` of (case, seed), shared by the strategies judged on
    the case (None: computed here).

    float64 cases also get ``gradcheck`` (when ``gradcheck``), the higher
    derivatives (when ``derivatives``: `derivative_errors`) and, when they ran,
    gradgradcheck on cases of at most `GRADGRADCHECK_ELEMENTS` input elements
    (``gradgradcheck`` None: with gradcheck, except for `SLOW_GRADGRADCHECK`).
    """
    if gradgradcheck is None:
        gradgradcheck = gradcheck and strategy not in SLOW_GRADGRADCHECK
    if expected is not None and expected.case != case:
        raise ValueError(f"expected is of case {expected.case.id}, not {case.id}")
    inputs = make_inputs(case, seed) if expected is None else expected.inputs
    result = CaseResult(strategy=strategy, case=case.id, dtype=dtype_name(case.dtype))
    if fn is None:
        bind = strategy_fn if case.flex is None else flex_strategy_fn
        fn, lse = bind(strategy), bind(strategy, return_lse=True)
        result.refused = refusal(strategy, case, inputs)
    if result.refused is not None:
        result.message = f"refused: {result.refused}"
        return result
    try:
        got = outputs_and_grads(fn, case, inputs, case.dtype)
        if lse is not None:
            got["lse"] = _lse(lse, case, inputs)
    except Exception as exc:  # a crash is a failed case, reported with its message
        result.message = f"{type(exc).__name__}: {exc}"
        return result
    verdicts = judge_run(expect(case, inputs) if expected is None else expected, got)
    for v in verdicts:
        result.errors[v.name] = v.error
        result.bounds[v.name] = v.bound
        result.ratios[v.name] = v.ratio
        if v.baseline is not None:
            result.baseline_errors[v.name] = v.baseline
        result.nan |= v.nan
    result.rule_passed = all(v.passed for v in verdicts)
    result.message = "; ".join(str(v) for v in verdicts if not v.passed)
    if case.dtype != torch.float64:
        return result
    failures = [result.message]
    if gradcheck:
        result.gradcheck_passed = gradcheck_passes(fn, case, inputs)
        failures.append("" if result.gradcheck_passed else "gradcheck failed")
    if derivatives:
        errors, messages = derivative_errors(fn, case, inputs, seed)
        result.second_order_error, result.jvp_error = errors["second_order"], errors["jvp"]
        failures += messages
    ran = derivatives and math.isfinite(result.second_order_error or 0.0)  # else failed above
    if gradgradcheck and ran and leaf_elements(inputs) <= GRADGRADCHECK_ELEMENTS:
        result.gradgradcheck_passed = gradgradcheck_passes(fn, case, inputs)
        failures.append("" if result.gradgradcheck_passed else "gradgradcheck failed")
    result.message = "; ".join(filter(None, failures))
    return result


def format_error(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1e}"
