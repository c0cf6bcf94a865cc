r"""The error rule: how far from float64 an implementation may be, in any dtype.

One rule for every dtype and every machine: an implementation's error against
`attngrad.verify.reference.reference_attention` (run in float64 on the
inputs as rounded to the case's dtype) is at most twice the error of the plain
PyTorch computation in that dtype, plus a floor that follows from the
magnitudes of what produces each quantity.  `judge` applies it to one
quantity, `judge_outputs` to every quantity of one run on a case.

The rule
--------
Element by element, for each compared quantity x (out, dq, dk, dv, dmask, dsinks)::

    |x_got - x_ref|  <=  2 max|x_plain - x_ref|
                         + u_c LAMBDA (sqrt(n) A_x + sqrt(d) C_x)
                         + u (DTYPE_ROUNDINGS A_x + 2 C_x)

* ``x_plain`` (`attngrad.verify.reference.plain_attention`): the plain PyTorch
  computation in the case's dtype, on the same rounded inputs.  Its error is
  the 2x rule serious kernel projects use.
* ``u``: the unit roundoff of the case's dtype (eps / 2); ``u_c`` that of
  the dtype the sums run in (float32 for 16-bit inputs, see
  `attngrad.core.ops.compute_dtype`; else the dtype itself).
* ``A_x`` (`attngrad.verify.reference.magnitudes`): the last step that forms x,
  evaluated in float64 on absolute values: P |v| for the output, P^T |dO|
  for dv, P o (|dO| |v|^T + rowsum(P o |dO| |v|^T)) for dS and so the mask's
  gradient, scale * |dS|-bound * |k| for dq, ...  The classical forward error
  bound of a sum of n products is |fl(a.b) - a.b| <= gamma_n |a|.|b| with
  gamma_n = n u / (1 - n u), reached only when every rounding goes the same
  way.  The probabilistic bound of Higham and Mary (SIAM J. Sci. Comput.
  41(5), 2019), which models roundings as independent and mean-independent,
  replaces gamma_n by lambda sqrt(n) u, holding with probability at least
  1 - 2 exp(-lambda^2 / 2) per sum; ``LAMBDA`` = 6 puts that at 1 - 3e-8.
  No BLAS kernel, blocking or thread count enters the bound.
* With dropout, P o Z / (1 - p) takes P's place on the paths to out and dv,
  and dP is scaled alike; with a softcap, the slope 1 - tanh^2 <= 1 of the
  cap multiplies the path from dS back to q and k; sinks join P's
  normalisation, and dsinks is bounded by p_sink rowsum(P o |dO| |v|^T).
* ``C_x`` (same function): what a perturbation of every score by at most
  C_S = scale |q| |k|^T (+ |S| for a bias, + the cap's roundings) does to
  x, to first order.  The
  d-term product behind each score rounds as above (LAMBDA sqrt(d) u_c), and
  q and k, rounded to the dtype, once each (2 u).  This is the term that
  large logits (|S| u no longer small) and huge biases make large, and only
  where P lets the scores reach x; the plain run's error also carries it,
  but a max over one draw of roundings is no bound for another draw.
* Single roundings to the dtype along a path to x, each bounded by u A_x in
  the worst case (no sqrt: they need not cancel): v and dO as inputs, an
  intermediate kept or multiplied in the dtype (the saved P or O, P or dS
  before a 16-bit product), the accumulators, the result itself:
  ``DTYPE_ROUNDINGS`` = 5.
* ``n``: the longest sum along the computation, max(d, dv, Nk, G * Nq, the
  number of score entries each element of a broadcast float mask collects,
  and the rows each per-head sink's gradient collects).
* Underflow: A_x is joined by n * tiny * M (tiny: the compute dtype's smallest
  normal number, so u_c * tiny is the absolute error of one rounding into the
  subnormal range; M: the product of the operands' largest magnitudes, what
  such an error is multiplied by on its way to x), and the result's own
  rounding by u * tiny of the dtype.  It matters only where A_x is zero or
  subnormal, e.g. a P that underflows in one order only.

The floor is what lets a correct implementation that sums in another order
pass where the plain computation happens to be exact (one key: P = 1 and
dS = 0 exactly, while dS = P * (dP - Delta) with Delta from dO . O leaves
|dP| u).  It follows the data, not max(1, |ref|): where P is zero (masked
keys, a bias at ``finfo.min`` beside live scores, dead rows) the floor is
zero too.  Where the scores cannot be trusted (a whole row of scores at
``finfo.min``, which swallow q k^T) the floor says so and grows; the tests
pin those rows to the answer the math gives by name.
NaN anywhere fails.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from attngrad.core.ops import compute_dtype
from attngrad.verify.cases import (
    Case,
    Inputs,
    as_attention,
    default_mask_shape,
    input_tensor,
    outputs_and_grads,
    reference_keywords,
)
from attngrad.verify.reference import magnitudes, plain_attention, reference_attention

__all__ = [
    "DTYPE_ROUNDINGS",
    "GRADIENTS",
    "LAMBDA",
    "PLAIN",
    "REFERENCE",
    "Verdict",
    "abs_error",
    "case_floors",
    "judge",
    "judge_outputs",
    "largest",
    "operand_scale",
    "rounding_floor",
    "terms",
    "unit_roundoff",
]

# the quantities the rule judges (a case has those of its inputs)
GRADIENTS = ("out", "dq", "dk", "dv", "dmask", "dsinks")
# lambda of the probabilistic bound (module docstring): it holds with probability 1 - 3e-8
LAMBDA = 6.0
# single roundings to the dtype along one path to a result: v and dO as inputs, one
# intermediate kept or multiplied in the dtype (saved P or O, P or dS before a 16-bit
# product), the result itself; and one more for the gradients' accumulators
DTYPE_ROUNDINGS = 5

# the two runs every judgement compares with, called like `attngrad.attention`: the float64
# reference and the plain computation in the case's dtype
REFERENCE = as_attention(reference_attention)
PLAIN = as_attention(plain_attention)


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


def rounding_floor(
    magnitude: torch.Tensor,
    sensitivity: torch.Tensor,
    dtype: torch.dtype,
    n: int,
    head_dim: int,
    operands: float = 1.0,
) -> torch.Tensor:
    """The rule's floor for one quantity (module docstring), shaped like it.

    magnitude: A_x, sensitivity: C_x (`attngrad.verify.reference.magnitudes`);
    operands: the product of the operands' largest magnitudes (`operand_scale`).
    The sums run in the compute dtype (float32 for 16-bit inputs), the few
    single roundings to the dtype in the dtype itself.
    """
    u_c, u = unit_roundoff(compute_dtype(dtype)), unit_roundoff(dtype)
    underflow = n * torch.finfo(compute_dtype(dtype)).tiny * operands
    sums = LAMBDA * (math.sqrt(n) * (magnitude + underflow) + math.sqrt(head_dim) * sensitivity)
    single = DTYPE_ROUNDINGS * magnitude + 2 * sensitivity + torch.finfo(dtype).tiny
    return u_c * sums + u * single


def judge(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    floor: torch.Tensor,
    plain: torch.Tensor | None = None,
) -> Verdict:
    """The rule for one quantity: |got - ref| <= 2 max|plain - ref| + floor, element by element.

    got: the implementation's x in any dtype; ref: the float64 reference;
    floor: `rounding_floor`; plain: the plain computation in the case's dtype
    (None: no baseline term).  All shaped alike.
    """
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(got.shape)} differs from {tuple(ref.shape)}")
    nan = bool(got.isnan().any())
    baseline = None if plain is None else largest(abs_error(plain.double(), ref))
    bound = 2 * (baseline or 0.0) + floor.double()
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


def abs_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|, zero where both are the same infinity."""
    return torch.where(a == b, 0.0, (a - b).abs())


def largest(t: torch.Tensor) -> float:
    """max(t) as a float; 0 for an empty tensor."""
    return float(t.max()) if t.numel() else 0.0


def judge_outputs(
    case: Case,
    inputs: Inputs,
    got: Mapping[str, torch.Tensor],
    names: Collection[str] | None = None,
) -> list[Verdict]:
    """Judge ``got`` (out and gradients of one run on ``inputs``) by the rule.

    Computes the float64 reference, the plain run in the case's dtype and the
    magnitudes itself.  names: the quantities to judge, in the reference's
    order (None: every one the reference has; an external function may give
    no dmask).
    """
    ref = outputs_and_grads(REFERENCE, case, inputs, torch.float64)
    plain = outputs_and_grads(PLAIN, case, inputs, case.dtype)
    floors = case_floors(case, inputs)
    return [
        judge(name, got[name], r, floors[name], plain[name])
        for name, r in ref.items()
        if names is None or name in names
    ]


def case_floors(case: Case, inputs: Inputs) -> dict[str, torch.Tensor]:
    """The rule's floor (`rounding_floor`) of each quantity of the case, shaped like it."""
    q, k, v, dout = (input_tensor(inputs, n) for n in ("q", "k", "v", "dout"))
    mags, sens = magnitudes(
        q, k, v, dout, inputs["mask"], unit_roundoff=unit_roundoff(case.dtype),
        sinks=inputs.get("sinks"), **reference_keywords(q, k, case.kwargs),  # type: ignore[arg-type]
    )  # fmt: skip
    n, operands, d = terms(case), operand_scale(case, inputs), case.shapes.head_dim
    return {
        name: rounding_floor(mags[name], sens[name], case.dtype, n, d, operands) for name in mags
    }


def operand_scale(case: Case, inputs: Inputs) -> float:
    """max(1, scale) times max(1, max|t|) for t in q, k, v, dout: what an underflow meets."""
    scale = case.scale if case.scale is not None else 1 / math.sqrt(case.shapes.head_dim)
    peaks = (largest(input_tensor(inputs, n).detach().abs()) for n in ("q", "k", "v", "dout"))
    return float(math.prod(max(1.0, x) for x in peaks)) * max(1.0, abs(scale))
