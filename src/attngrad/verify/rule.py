r"""The error rule: how far from float64 an implementation may be, in any dtype.

One rule for every dtype and every machine: an implementation's error against
`attngrad.verify.reference.reference_attention` is at most twice the error of
the plain PyTorch computation in that dtype (or what a fused kernel's 16-bit
products may cost, if larger), plus a floor for what a correct implementation
may legitimately compute differently.  `judge` applies it to one quantity;
`expect` computes what a case's runs are judged against (the reference, the
plain run and the bounds, once per case and inputs) and `judge_run` judges
every quantity of one run by it (`judge_outputs`: both at once).  The
words below (received, plain run, floor, kept, readback, the P move) are
defined once in the glossary, docs/glossary.md.

The reference sees what the kernel sees: the inputs (q, k, v, mask, sinks,
dO) rounded to the case's dtype, then taken to float64 (`received`).  So no
term of the bound has to absorb the inputs' own rounding, and in 16 bits the
bound is a few units of roundoff of each quantity: a gradient 5% off in
bfloat16 fails at every size tests/verify/test_planted.py tries.

The rule
--------
Element by element, for each compared quantity x (out, dq, dk, dv, dmask, dsinks)::

    |x_got - x_ref|  <=  max(2 max|x_plain - x_ref|,  u K_x)
                         + u_c (LAMBDA sqrt(n) A_x + (LAMBDA sqrt(d) + SCORE_ROUNDINGS) C_x)
                         + u (|x_ref| + R_x)

* ``x_plain`` (`attngrad.verify.reference.plain_attention`): the plain PyTorch
  computation in the case's dtype, on the same inputs.  Its error is the 2x
  rule serious kernel projects use; it rounds scores, P and dS to the dtype
  on the way.
* ``u``: the unit roundoff of the case's dtype (eps / 2); ``u_c`` that of
  the dtype the sums run in (float32 for 16-bit inputs, see
  `attngrad.core.ops.compute_dtype`; else the dtype itself).
* ``K_x``: what a fused kernel's 16-bit products cost: P kept in the dtype
  for P v and P^T dO, dS for dS k and dS^T q, each rounded once, bounded by
  the worst case or, for long sums, LAMBDA times the root-sum-square of the
  rounded terms (`attngrad.verify.bounds.magnitudes`).  The plain run
  pays these and more, so over a large tensor 2x its largest error covers
  them; over a few elements (a short row, one live key) its largest error
  is one small draw of roundings, and K_x is the bound that does not depend
  on the draw.  Either justifies a kernel: the larger is taken.

The floor, derived, not measured, is what a correct implementation computes
differently from both the reference and the plain run:

* The order of its sums, in the compute dtype.  ``A_x``
  (`attngrad.verify.bounds.magnitudes`): the last step that forms x,
  evaluated in float64 on absolute values: P |v| for the output, P^T |dO|
  for dv, P o (|dO| |v|^T + rowsum(P o |dO| |v|^T)) for dS and so the mask's
  gradient, scale * |dS|-bound * |k| for dq, ...  The classical forward error
  bound of a sum of n products is |fl(a.b) - a.b| <= gamma_n |a|.|b| with
  gamma_n = n u / (1 - n u), reached only when every rounding goes the same
  way.  The probabilistic bound of Higham and Mary (SIAM J. Sci. Comput.
  41(5), 2019), which models roundings as independent and mean-independent,
  replaces gamma_n by lambda sqrt(n) u, holding with probability at least
  1 - 2 exp(-lambda^2 / 2) per sum; ``LAMBDA`` = 6 puts that at 1 - 3e-8.
  No BLAS kernel, blocking, tile size or thread count enters the bound.
  ``n``: the longest sum along the computation, max(d, dv, Nk, G * Nq, the
  number of score entries each element of a broadcast float mask collects,
  and the rows each per-head sink's gradient collects).
* The rounding of its scores, in the compute dtype.  ``C_x`` (same
  function): what a perturbation of every score by at most e C_S does to x,
  to first order but for P's move and dS's product of P's and Delta's moves
  (kept whole: a bias that swamps the scores moves P by P itself), per unit
  e, with C_S = scale |q| |k|^T (+ |S| for a bias,
  + the cap's roundings).  Each score is a d-term product (LAMBDA sqrt(d)
  u_c, as above) passed through a few single roundings of at most u_c C_S
  each: the scale, the bias add, the row-max shift and the change of base
  of exp (``SCORE_ROUNDINGS`` = 4; `score_error` is e).  This is the term
  that large logits (|S| u_c no longer small) and huge biases make large,
  and only where P lets the scores reach x.
* The storage of its result in the dtype: one rounding to nearest of the
  value the terms above let a correct kernel reach, u (|x_ref| + those
  terms).  In 16 bits this is mostly the floor's largest term, 0.4% of x in
  bfloat16; where the scores' term dwarfs |x_ref| (a -1e9 bias swamping the
  scores, P moved to uniform) it is u times that move.
* ``R_x``: Delta = rowsum(dO o O) formed from O as the kernel stored it
  (16-bit storage and a kept P: O off by u (|O| + K_out)), the same move for
  every key of a row (`attngrad.verify.bounds.magnitudes`).  The plain
  run forms Delta from P and dP instead, so it need not pay this.
* With dropout, P o Z / (1 - p) takes P's place on the paths to out and dv,
  and dP is scaled alike; with a softcap, the slope 1 - tanh^2 <= 1 of the
  cap multiplies the path from dS back to q and k; sinks join P's
  normalisation, and dsinks is bounded by p_sink rowsum(P o |dO| |v|^T).
* Underflow: A_x is joined by n * tiny * M (tiny: the compute dtype's smallest
  normal number, so u_c * tiny is the absolute error of one rounding into the
  subnormal range; M: the product of the operands' largest magnitudes, what
  such an error is multiplied by on its way to x), and the result's own
  rounding by u * tiny of the dtype.  It matters only where A_x is zero or
  subnormal, e.g. a P that underflows in one order only.

The floor is what lets a correct implementation that sums in another order
pass where the plain computation happens to be exact (one key: P = 1 and
dS = 0 exactly, while dS = P * (dP - Delta) with Delta from dO . O leaves
|dP| u_c).  It follows the data, not max(1, |ref|): where P is zero (masked
keys, a bias at ``finfo.min`` beside live scores, dead rows) the floor is
zero too.  Where the scores cannot be trusted (a whole row of scores at
``finfo.min``, which swallow q k^T) the floor says so and grows; the tests
pin those rows to the answer the math gives by name.
NaN anywhere fails.  A plain run that overflows (float16 inputs near its max:
scores past 65504 in the dtype) is not finite where the reference is; it says
nothing of the dtype's rounding then, and the rule drops its 2x term (kept +
floor alone).

FlexAttention
-------------
A flex case (`attngrad.verify.flex_cases`) is judged by the same rule against
`attngrad.verify.flex_reference.reference_flex_attention`, with
`plain_flex_attention` as its plain run, and one more quantity, ``dtheta``:
the gradient of the tensor its score function reads.  Its floor is derived as
above with the score function in the cap's place: its slope f' multiplies the
paths from dS back to q and k, each score's perturbation is |f'| C_X plus the
roundings inside f, and the slope moves by |f''| C_X plus f's and autograd's
roundings on it -- all from a first-order error analysis of the function's own
ops (`attngrad.verify.score_rounding`), not from any machine.  dtheta sums
dS J over the scores (J = dT/dtheta), its n the most scores one element of
theta collects (`attngrad.verify.bounds.flex_magnitudes`); it is stored in
theta's own dtype (float32 beside bfloat16 q, k, v, as a model's parameters
under mixed precision: `attngrad.verify.cases.Case.theta_dtype`), one
rounding of that dtype's unit roundoff in the storage term.

lse, where an implementation returns it (``got["lse"]`` of `judge_run`),
answers to a floor of the compute dtype alone (`lse_floor`): attention
returns it in the compute dtype whatever the inputs.

The rule's power is measured, not assumed: `attngrad.verify.planted` plants
bugs in copies of a strategy (a gradient 5% off in 16 bits and 1% in
float32, the softmax backward without its row sum, lse kept in 16 bits --
seen by the lse verdict: in 16-bit inputs it moves the gradients no more
than plain 16-bit PyTorch errs --, zeros, a skipped tile rescale);
tests/verify/test_planted.py checks each fails at realistic sizes with
several tiles, and benchmarks/benchmark_rule_power.py prints the margin between
correct code's worst ratio and each bug's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from attngrad.core.ops import compute_dtype
from attngrad.verify.bounds import LAMBDA, Magnitudes, flex_magnitudes, magnitudes
from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    as_attention,
    call_flex,
    default_mask_shape,
    input_tensor,
    outputs_and_grads,
    received,
    reference_keywords,
)
from attngrad.verify.flex_cases import block_mask, scenario
from attngrad.verify.flex_reference import (
    plain_flex_attention,
    reference_flex_attention,
    reference_flex_lse,
)
from attngrad.verify.reference import plain_attention, reference_attention, reference_lse

__all__ = [
    "FLEX_PLAIN",
    "FLEX_REFERENCE",
    "GRADIENTS",
    "LAMBDA",
    "PLAIN",
    "REFERENCE",
    "SCORE_ROUNDINGS",
    "Expected",
    "Verdict",
    "abs_error",
    "case_bounds",
    "case_floors",
    "expect",
    "judge",
    "judge_outputs",
    "judge_run",
    "kept_bound",
    "largest",
    "lse_floor",
    "operand_scale",
    "plain_fn",
    "reference_fn",
    "rounding_floor",
    "score_error",
    "terms",
    "unit_roundoff",
]

# the quantities the rule judges (a case has those of its inputs; lse where the
# implementation returns it, `lse_floor`)
GRADIENTS = ("out", "dq", "dk", "dv", "dmask", "dsinks", "dtheta", "lse")
# single roundings of each score in the compute dtype besides its d-term product: the scale,
# the bias add, the row-max shift and the change of base of exp (module docstring)
SCORE_ROUNDINGS = 4

# the two runs every judgement compares with, called like `attngrad.attention`: the float64
# reference and the plain computation in the case's dtype
REFERENCE = as_attention(reference_attention)
PLAIN = as_attention(plain_attention)
# the same two for a flex case, called like `attngrad.flex_attention`
FLEX_REFERENCE: AttentionFn = reference_flex_attention
FLEX_PLAIN: AttentionFn = plain_flex_attention


def reference_fn(case: Case) -> AttentionFn:
    """The float64 reference the case is judged against: `FLEX_REFERENCE` for a flex case,
    else `REFERENCE`."""
    return REFERENCE if case.flex is None else FLEX_REFERENCE


def plain_fn(case: Case) -> AttentionFn:
    """The plain run of the case's 2x term: `FLEX_PLAIN` for a flex case, else `PLAIN`."""
    return PLAIN if case.flex is None else FLEX_PLAIN


@dataclass(frozen=True)
class Verdict:
    """The rule applied to one quantity.

    ``error``: the max error over all elements.  ``worst``: the element whose
    error is largest relative to its own bound, with that error
    (``worst_error``), that ``bound`` and their ``ratio`` (<= 1 passes).
    """

    name: str
    error: float
    worst_error: float
    bound: float
    ratio: float
    baseline: float | None
    nan: bool
    worst: tuple[int, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.nan and self.ratio <= 1.0

    def __str__(self) -> str:
        if self.nan:
            return f"{self.name}: NaN"
        at = f" at {list(self.worst)}" if self.worst else ""
        op = "<=" if self.passed else ">"
        return f"{self.name}: error {self.worst_error:.3g} {op} bound {self.bound:.3g}{at}"


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of ``dtype``: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def terms(case: Case) -> int:
    """n of the rule: the longest sum along the case's computation."""
    sh = case.shapes
    n = max(sh.head_dim, sh.value_dim, sh.seq_k, sh.groups * sh.seq_q, 1)
    if case.mask == "float":
        mask_elems = math.prod(case.mask_shape or default_mask_shape(case))
        n = max(n, math.prod((*sh.lead, sh.heads_q, sh.seq_q, sh.seq_k)) // max(1, mask_elems))
    if case.sinks == "head":  # each sink's gradient collects every row of its head
        n = max(n, math.prod((*sh.lead, sh.seq_q)))
    return n


def score_error(dtype: torch.dtype, head_dim: int) -> float:
    """e of the rule: the relative error of one score, in units of C_S, for inputs in ``dtype``.

    A d-term product in the compute dtype and `SCORE_ROUNDINGS` single roundings
    (module docstring); `attngrad.verify.bounds.magnitudes` takes it.
    """
    return unit_roundoff(compute_dtype(dtype)) * (LAMBDA * math.sqrt(head_dim) + SCORE_ROUNDINGS)


def rounding_floor(
    magnitude: torch.Tensor,
    sensitivity: torch.Tensor,
    dtype: torch.dtype,
    n: int,
    head_dim: int,
    operands: float = 1.0,
    result: torch.Tensor | None = None,
    readback: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule's floor for one quantity (module docstring), shaped like it.

    magnitude: A_x, sensitivity: C_x, readback: R_x
    (`attngrad.verify.bounds.magnitudes`, given `score_error`; None: no
    Delta on the way); operands: the product of the operands' largest
    magnitudes (`operand_scale`); result: |x_ref|, whose storage in ``dtype``
    rounds once (None: its bound, the magnitude).  The sums and the scores
    run in the compute dtype (float32 for 16-bit inputs), O and the result
    are stored in the dtype itself: the stored value is x_ref moved by the
    sums' and the scores' terms, rounded once.
    """
    u_c, u = unit_roundoff(compute_dtype(dtype)), unit_roundoff(dtype)
    underflow = n * torch.finfo(compute_dtype(dtype)).tiny * operands
    sums = u_c * LAMBDA * math.sqrt(n) * (magnitude + underflow)
    scores = score_error(dtype, head_dim) * sensitivity
    moved = sums + scores
    stored = (magnitude if result is None else result).abs() + moved + torch.finfo(dtype).tiny
    if readback is not None:
        stored = stored + readback
    return moved + u * stored


def judge(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    floor: torch.Tensor,
    plain: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> Verdict:
    """The rule for one quantity, element by element:
    |got - ref| <= max(2 max|plain - ref|, kept) + floor.

    got: the implementation's x in any dtype; ref: the float64 reference;
    floor: `rounding_floor`; plain: the plain computation in the case's dtype
    (None, or not finite where the reference is: no baseline term); kept:
    `kept_bound` (None: none).  All shaped alike.
    """
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(got.shape)} differs from {tuple(ref.shape)}")
    nan = bool(got.isnan().any())
    baseline = None if plain is None else _plain_error(plain.double(), ref)
    allowance = torch.full_like(ref, 2 * (baseline or 0.0))
    if kept is not None:
        allowance = torch.maximum(allowance, kept.double())
    bound = allowance + floor.double()
    err = abs_error(got, ref)
    if err.numel() == 0:
        return Verdict(name, 0.0, 0.0, 0.0, 0.0, baseline, False)
    # err / bound, with 0 / 0 = 0 (an exact zero where nothing could round) and NaN = inf
    ratio = torch.where(err == 0, 0.0, err / bound).nan_to_num(nan=math.inf)
    worst = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
    return Verdict(
        name, largest(err), float(err[worst]), float(bound[worst]), float(ratio[worst]),
        baseline, nan, worst,
    )  # fmt: skip


def _plain_error(plain: torch.Tensor, ref: torch.Tensor) -> float | None:
    """max|plain - ref|, or None where the plain run is not finite and the reference is: it
    overflowed (float16 inputs near its max), which says nothing of the dtype's rounding."""
    if bool((~plain.isfinite() & ref.isfinite()).any()):
        return None
    return largest(abs_error(plain, ref))


def abs_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|, zero where both are the same infinity."""
    return torch.where(a == b, 0.0, (a - b).abs())


def largest(t: torch.Tensor) -> float:
    """max(t) as a float; 0 for an empty tensor."""
    return float(t.max()) if t.numel() else 0.0


@dataclass(frozen=True)
class Expected:
    """What a run on one case's inputs is judged against (`expect`), shared by every run on them.

    inputs: the case's inputs as drawn, what each implementation is handed;
    ref: the float64 reference on them as received (`received`): out, dq, dk,
    dv (dmask, dsinks) and lse [..., Hq, Nq]; plain: the plain run in the case's
    dtype (no lse); floors and kept: `case_bounds` of each quantity of ref.
    Each tensor is shaped like its quantity.
    """

    case: Case
    inputs: Inputs
    ref: dict[str, torch.Tensor]
    plain: dict[str, torch.Tensor]
    floors: dict[str, torch.Tensor]
    kept: dict[str, torch.Tensor]


def expect(case: Case, inputs: Inputs) -> Expected:
    """The float64 reference, the plain run and the bounds of every quantity of the case.

    Taken on the inputs as the implementation received them (`received`); the
    expensive half of the rule, computed once per case and inputs and shared
    by every implementation judged on them (`judge_run`).
    """
    exact = received(inputs, case.dtype, case.input_dtypes(case.dtype))
    ref = outputs_and_grads(reference_fn(case), case, exact, torch.float64)
    ref["lse"] = _reference_lse(case, exact)
    plain = outputs_and_grads(plain_fn(case), case, exact, case.dtype)
    floors, kept = case_bounds(case, exact, ref)
    return Expected(case, inputs, ref, plain, floors, kept)


def judge_run(
    expected: Expected, got: Mapping[str, torch.Tensor], names: Collection[str] | None = None
) -> list[Verdict]:
    """Judge ``got`` (out and gradients of one run on ``expected.inputs``, and lse
    [..., Hq, Nq] if given, `lse_floor`) by the rule.

    names: the quantities to judge, in the reference's order (None: every one
    the reference has, lse where ``got`` has it; an external function may give
    no dmask).
    """
    e = expected
    if names is None:
        names = [name for name in e.ref if name != "lse" or "lse" in got]
    return [
        judge(name, got[name], r, e.floors[name], e.plain.get(name), e.kept.get(name))
        for name, r in e.ref.items()
        if name in names
    ]


def judge_outputs(
    case: Case,
    inputs: Inputs,
    got: Mapping[str, torch.Tensor],
    names: Collection[str] | None = None,
) -> list[Verdict]:
    """`judge_run` on the case's `expect`: for one run; a second run on the same
    inputs shares the expectation by calling those two itself."""
    return judge_run(expect(case, inputs), got, names)


def _reference_lse(case: Case, inputs: Inputs) -> torch.Tensor:
    """The float64 lse of the case's rows on ``inputs`` (dropout does not enter it)."""
    if case.flex is not None:

        def lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
            return reference_flex_lse(q, k, **kw)  # type: ignore[arg-type]

        leaves = {n: input_tensor(inputs, n).detach() for n in ("q", "k", "v")}
        return call_flex(lse, case, inputs, leaves)
    q, k = input_tensor(inputs, "q"), input_tensor(inputs, "k")
    kw = {n: x for n, x in case.kwargs.items() if n not in ("dropout_p", "generator")}
    sinks = {"sinks": inputs["sinks"]} if inputs.get("sinks") is not None else {}
    return reference_lse(q, k, inputs["mask"], **sinks, **kw)  # type: ignore[arg-type]


def lse_floor(moved: torch.Tensor, ref: torch.Tensor, case: Case) -> torch.Tensor:
    """The floor of lse [..., Hq, Nq], which attention returns in the compute dtype (float32
    for 16-bit inputs): no 2x term and no kept bound, as the plain run's lse would be in the
    dtype itself.

    moved: rowsum(P o C_S) (`attngrad.verify.bounds.Magnitudes`); ref: the
    float64 lse.  Each score may be off by e C_S (`score_error`), so lse by
    e rowsum(P o C_S) (d lse / d S = P); l sums n positive terms, each exp off
    by a unit or two, so log l moves by u_c (LAMBDA sqrt(n) + 2); log and
    m + log l round once each, by at most u_c (log n + |lse|).  n: the keys
    (and the sink).  A dead row's -inf is exact.
    """
    n = case.shapes.seq_k + (case.sinks != "none")
    u_c = unit_roundoff(compute_dtype(case.dtype))
    size = torch.where(ref.isfinite(), ref.abs(), 0.0)
    e = score_error(case.dtype, case.shapes.head_dim)
    return e * moved + u_c * (LAMBDA * math.sqrt(n) + 2 + math.log(max(n, 1)) + size)


def case_floors(
    case: Case, inputs: Inputs, ref: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The rule's floor (`rounding_floor`) of each quantity of the case, shaped like it.

    inputs: as the implementation received them (`received`); ref: the
    float64 reference on them (None: computed here).
    """
    if ref is None:
        ref = outputs_and_grads(reference_fn(case), case, inputs, torch.float64)
    return case_bounds(case, inputs, ref)[0]


def kept_bound(kept: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """u K_x: what P and dS kept in ``dtype`` for its products can do to x (module
    docstring); K_x from `attngrad.verify.bounds.magnitudes`."""
    return unit_roundoff(dtype) * kept


def case_bounds(
    case: Case, inputs: Inputs, ref: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(floor, kept bound) of each quantity (`rounding_floor`, `kept_bound`), shaped like it.

    inputs: as the implementation received them (`received`); ref: the float64
    reference on them.  The rule without its 2x term is |got - ref| <= kept +
    floor: what a kernel that keeps its scores and sums in the compute dtype
    answers to where the plain run is too far off to say anything (large
    logits in 16 bits).
    """
    q, k, v, dout = (input_tensor(inputs, n) for n in ("q", "k", "v", "dout"))
    d = case.shapes.head_dim
    n = terms(case)
    if case.flex is None:
        a, c, r, kept, moved = magnitudes(
            q, k, v, dout, inputs["mask"], score_error=score_error(case.dtype, d),
            sinks=inputs.get("sinks"), **reference_keywords(q, k, case.kwargs),  # type: ignore[arg-type]
        )  # fmt: skip
    else:
        (a, c, r, kept, moved), theta_terms = _flex_magnitudes(case, inputs)
        n = max(n, theta_terms)
    operands = operand_scale(case, inputs)
    floors = {
        name: rounding_floor(a[name], c[name], case.dtype, n, d, operands, ref[name], r[name])
        for name in a
    }
    theta = case.input_dtypes(case.dtype).get("theta")
    if theta is not None and "dtheta" in a:  # stored in theta's own dtype: u_theta |x_ref|
        stored = unit_roundoff(theta) * ref["dtheta"].abs()
        floors["dtheta"] = stored + rounding_floor(
            a["dtheta"], c["dtheta"], case.dtype, n, d, operands,
            torch.zeros_like(ref["dtheta"]), r["dtheta"],
        )  # fmt: skip
    if "lse" in ref:
        floors["lse"] = lse_floor(moved, ref["lse"], case)
    return floors, {name: kept_bound(kept[name], case.dtype) for name in a}


def _flex_magnitudes(case: Case, inputs: Inputs) -> tuple[Magnitudes, int]:
    """`attngrad.verify.bounds.flex_magnitudes` of a flex case on ``inputs``."""
    s = scenario(case.flex or "")
    q, k, v, dout = (input_tensor(inputs, n) for n in ("q", "k", "v", "dout"))
    return flex_magnitudes(
        q, k, v, dout, s.score, inputs.get("theta"),
        block_mask(s.name, case.shapes.seq_q, case.shapes.seq_k), case.scale, case.gqa,
        score_error(case.dtype, case.shapes.head_dim),
    )  # fmt: skip


def operand_scale(case: Case, inputs: Inputs) -> float:
    """max(1, scale) times max(1, max|t|) for t in q, k, v, dout: what an underflow meets."""
    scale = case.scale if case.scale is not None else 1 / math.sqrt(case.shapes.head_dim)
    peaks = (largest(input_tensor(inputs, n).detach().abs()) for n in ("q", "k", "v", "dout"))
    return float(math.prod(max(1.0, x) for x in peaks)) * max(1.0, abs(scale))
