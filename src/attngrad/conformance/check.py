r"""The conformance harness: judge an attention implementation against float64.

For one `Case` and one strategy (or any SDPA-like function) it computes the
output and every gradient (dq, dk, dv and, for a float mask, dmask, for
sinks, dsinks), compares each with `attngrad.conformance.reference.reference_attention`
run in float64, and judges the difference with one rule, the same for every
dtype and every machine.  A case may add `attngrad.attention`'s options
beyond SDPA's (softcap, sinks, bottom-right alignment, packed segments,
dropout); a dropout case hands every call a generator seeded alike
(`DROPOUT_SEED`), and the reference applies the keep mask attention draws
from it (`dropout_mask`, `as_attention`), so all of them see one mask.

The rule
--------
Element by element, for each compared quantity x (out, dq, dk, dv, dmask, dsinks)::

    |x_got - x_ref|  <=  2 max|x_plain - x_ref|
                         + u_c LAMBDA (sqrt(n) A_x + sqrt(d) C_x)
                         + u (DTYPE_ROUNDINGS A_x + 2 C_x)

* ``x_plain`` (`attngrad.conformance.reference.plain_attention`): the plain PyTorch
  computation in the case's dtype, on the same rounded inputs.  Its error is
  the 2x rule serious kernel projects use.
* ``u``: the unit roundoff of the case's dtype (eps / 2); ``u_c`` that of
  the dtype the sums run in (float32 for 16-bit inputs, see
  `attngrad.core.ops.compute_dtype`; else the dtype itself).
* ``A_x`` (`attngrad.conformance.reference.magnitudes`): the last step that forms x,
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
NaN anywhere fails.  On float64 cases ``gradcheck`` also runs (fast mode: a
random projection of the Jacobian against finite differences).

Higher derivatives (float64 cases)
----------------------------------
Beside the rule, each float64 case compares two more derivatives with
autograd through the float64 composite `attngrad.conformance.reference.reference_attention`:

* ``second_order_error``: double backward.  With w = the case's dout and
  fixed random directions u (`directions`), g = grad(<O, w>, x,
  create_graph=True) for x = (q, k, v[, mask][, sinks], w), then
  H = grad(sum_i <g_i, u_i>, x): a Hessian-vector product in q, k, v, the
  mask and the sinks, and J u in w (`second_order`).
* ``jvp_error``: forward mode, ``torch.func.jvp`` of the output along the
  tangents u of q, k, v and a float mask (`output_tangent`).

Each is one number, the max abs error over every element of every result
relative to the reference's largest magnitude, floored at 1
(`relative_error`): max_i max|H_i - H_i_ref| / max(1, max_i max|H_i_ref|).
The floor makes it an absolute error where every result is small (one key:
P = 1, the Hessian is exactly zero and a correct path leaves rounding).
Both must be at most ``DERIVATIVE_TOLERANCE`` = 1e-9 (the issue's "agree at
1e-9 in float64").  In float64 (u = 2^-53 = 1.1e-16) that is about 10^7 u:
every result here is a few chained sums of n <= 10^3 products of O(1)
numbers, each within 6 sqrt(n) u ~ 2e-14 of its magnitudes by the bound
above, and the grid's errors come out below 1e-14 on every strategy.  The
margin of 10^5 over that covers magnitudes that cancel in the result; a
wrong or missing term is wrong by O(1) of the result and fails by 10^8.
NaN or a crash fails.  ``gradgradcheck`` (fast mode, finite differences of
the first-order backward, dout included) also runs on float64 cases of at
most ``GRADGRADCHECK_ELEMENTS`` input elements, unless gradcheck is off
(and not on triton, whose interpreter makes it slow: ``SLOW_GRADGRADCHECK``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import cast

import torch
from torch.autograd.gradcheck import GradcheckError

from attngrad.api import attention
from attngrad.conformance.reference import magnitudes, plain_attention, reference_attention
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from attngrad.core.ops import compute_dtype

__all__ = [
    "DERIVATIVES",
    "DERIVATIVE_TOLERANCE",
    "DROPOUT_SEED",
    "GRADGRADCHECK_ELEMENTS",
    "GRADIENTS",
    "LAMBDA",
    "MASK_KINDS",
    "SINK_KINDS",
    "SLOW_GRADGRADCHECK",
    "Case",
    "CaseResult",
    "Verdict",
    "as_attention",
    "case_floors",
    "default_cases",
    "derivative_errors",
    "directions",
    "dropout_mask",
    "judge",
    "judge_outputs",
    "make_inputs",
    "output_tangent",
    "outputs_and_grads",
    "relative_error",
    "rounding_floor",
    "run_case",
    "second_order",
    "strategy_fn",
]

MASK_KINDS = ("none", "causal", "bool", "float")
# attention sinks: none, one logit per head ([Hq]) or one per query row ([*lead, Hq, Nq])
SINK_KINDS = ("none", "head", "token")
GRADIENTS = ("out", "dq", "dk", "dv", "dmask", "dsinks")
LAMBDA = 6.0
# single roundings to the dtype along one path to a result: v and dO as inputs, one
# intermediate kept or multiplied in the dtype (saved P or O, P or dS before a 16-bit
# product), the result itself; and one more for the gradients' accumulators
DTYPE_ROUNDINGS = 5
# the higher derivatives of a float64 case (module docstring): double backward, forward mode
DERIVATIVES = ("second_order", "jvp")
DERIVATIVE_TOLERANCE = 1e-9
# gradgradcheck's float64 cases: q, k, v, dout and a float mask together at most this many
# elements (every case of the default grid: fast mode costs a few backward passes each)
GRADGRADCHECK_ELEMENTS = 100_000
# strategies whose gradgradcheck `run_case` leaves out unless asked: on CPU tensors triton runs
# in Triton's interpreter, where one takes ~15 s (the check's 16 float64 cases: 4 minutes)
SLOW_GRADGRADCHECK = frozenset({"triton"})
# the seed of the generator every dropout case hands attention (fresh at each call), so every
# strategy, every pass of gradcheck and the reference see one keep mask
DROPOUT_SEED = 0xD0

Inputs = dict[str, torch.Tensor | None]
AttentionFn = Callable[..., torch.Tensor]
Window = tuple[int | None, int | None] | None


@dataclass(frozen=True)
class Case:
    """One conformance case: the sizes, the dtype and what constrains the scores.

    ``mask`` is one of MASK_KINDS; ``mask_shape`` the shape of a bool/float
    mask (anything broadcastable to the scores [*lead, Hq, Nq, Nk]; None: the
    case's default).  ``scale`` None is 1/sqrt(d); ``window``, ``softcap``
    and ``align`` as in `attngrad.attention`.  ``enable_gqa`` None means
    "when Hq != Hkv".  ``sinks``: one of SINK_KINDS (`make_inputs` draws
    them).  ``segments``: packed sequences as (query lengths, key lengths),
    e.g. ``((3, 2), (2, 4))`` for cu_seqlens_q = [0, 3, 5], cu_seqlens_k =
    [0, 2, 6].  ``dropout``: dropout_p, drawn from a generator seeded with
    `DROPOUT_SEED`.
    """

    shapes: Shapes
    dtype: torch.dtype = torch.float64
    mask: str = "none"
    mask_shape: tuple[int, ...] | None = None
    scale: float | None = None
    window: Window = None
    enable_gqa: bool | None = None
    softcap: float | None = None
    sinks: str = "none"
    align: str = "top-left"
    segments: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    dropout: float = 0.0

    @property
    def gqa(self) -> bool:
        """The ``enable_gqa`` the case calls attention with."""
        if self.enable_gqa is not None:
            return self.enable_gqa
        return self.shapes.heads_q != self.shapes.heads_kv

    @property
    def id(self) -> str:
        """A readable id built from the shape, e.g. ``B2-H4:2-N33x47-d16:24-float32-causal``.

        ``B`` lists the leading dims (``Bnone`` without any: the chapter's
        ``[B, N, d]`` layout, whose first dim plays the heads); ``H4:2`` is Hq:Hkv,
        ``N17x47`` Nq x Nk, ``d59:24`` d:dv.  Equal pairs are written once.
        Attention's options beyond SDPA's come before the mask, so no id is
        another's beginning: ``bottom-right``, ``cap1.5`` (softcap),
        ``sink:head``, ``seg10+7+16x20+0+27`` (the query and key segments'
        lengths), ``drop0.2`` (dropout_p); ``w8,2`` (window) and ``scale0.3``
        come after it.
        """
        sh = self.shapes
        batch = "x".join(map(str, sh.lead)) or "none"
        parts = [
            f"B{batch}",
            "H" + _pair(sh.heads_q, sh.heads_kv, ":"),
            "N" + _pair(sh.seq_q, sh.seq_k, "x"),
            "d" + _pair(sh.head_dim, sh.value_dim, ":"),
            str(self.dtype).removeprefix("torch."),
            *self._options(),
            self.mask + ("" if self.mask_shape is None else str(list(self.mask_shape))),
        ]
        if self.window is not None:
            parts.append(f"w{self.window[0]},{self.window[1]}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        return "-".join(parts).replace(" ", "")

    def _options(self) -> list[str]:
        """The id's parts for the options beyond SDPA's (`id`)."""
        parts = [] if self.align == "top-left" else [self.align]
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks != "none":
            parts.append(f"sink:{self.sinks}")
        if self.segments is not None:
            parts.append("seg" + "x".join("+".join(map(str, n)) for n in self.segments))
        if self.dropout:
            parts.append(f"drop{self.dropout:g}")
        return parts

    @property
    def kwargs(self) -> dict[str, object]:
        """The keyword arguments the case passes to an SDPA-like function (`attention`'s).

        Only what the case sets beyond SDPA's is_causal and enable_gqa; a
        dropout case gets a fresh ``generator`` seeded with `DROPOUT_SEED` at
        each access.  The sinks are an input (`make_inputs`), not a keyword here.
        """
        kw: dict[str, object] = {"is_causal": self.mask == "causal", "enable_gqa": self.gqa}
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.window is not None:
            kw["window"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        if self.align != "top-left":
            kw["align"] = self.align
        if self.segments is not None:
            kw["cu_seqlens_q"], kw["cu_seqlens_k"] = (_cumulative(n) for n in self.segments)
        if self.dropout:
            kw["dropout_p"] = self.dropout
            kw["generator"] = torch.Generator().manual_seed(DROPOUT_SEED)
        return kw


def _cumulative(lengths: tuple[int, ...]) -> torch.Tensor:
    """cu_seqlens [0, n0, n0 + n1, ...] (int64) of segment lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def dropout_mask(
    query: torch.Tensor, key: torch.Tensor, dropout_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The keep mask Z `attention` draws from ``generator``: bool [*lead, Hq, Nq, Nk].

    query: [*lead, Hq, Nq, d], key: [*lead, Hkv, Nk, d]; the same (seed,
    offset) draw and hash as attention's (`attngrad.core.dropout`).
    """
    *lead, heads, seq_q, _ = query.shape
    drop = Dropout(float(dropout_p), *draw_seed(query.device, generator))
    z = keep_mask(drop, math.prod(lead), heads, seq_q, key.shape[-2], query.device)
    return z.reshape(*lead, heads, seq_q, key.shape[-2])


def _reference_keywords(
    query: torch.Tensor, key: torch.Tensor, kwargs: Mapping[str, object]
) -> dict[str, object]:
    """`attention`'s keywords as the reference functions take them: ``generator`` becomes
    the keep mask attention draws from it (``dropout_mask``)."""
    kw = dict(kwargs)
    generator = cast("torch.Generator | None", kw.pop("generator", None))
    dropout_p = cast(float, kw.get("dropout_p", 0.0))
    if dropout_p > 0:
        kw["dropout_mask"] = dropout_mask(query, key, dropout_p, generator)
    return kw


def as_attention(reference: AttentionFn) -> AttentionFn:
    """A function of `attngrad.conformance.reference` called like `attention`: with ``dropout_p`` it
    applies the keep mask attention draws from ``generator`` (`dropout_mask`)."""

    def fn(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return reference(query, key, value, attn_mask, **_reference_keywords(query, key, kwargs))

    return fn


_REFERENCE = as_attention(reference_attention)
_PLAIN = as_attention(plain_attention)


def _pair(a: int, b: int, sep: str) -> str:
    return f"{a}" if a == b else f"{a}{sep}{b}"


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
        mask_elems = math.prod(case.mask_shape or _default_mask_shape(case))
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

    magnitude: A_x, sensitivity: C_x (`attngrad.conformance.reference.magnitudes`);
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
    baseline = None if plain is None else _max(_diff(plain.double(), ref))
    bound = 2 * (baseline or 0.0) + floor.double()
    err = _diff(got, ref)
    if err.numel() == 0:
        return Verdict(name, 0.0, 0.0, 0.0, 0.0, baseline, False)
    # err / bound, with 0 / 0 = 0 (an exact zero where nothing could round) and NaN = inf
    ratio = torch.where(err == 0, 0.0, err / bound).nan_to_num(nan=math.inf)
    worst = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
    return Verdict(
        name, _max(err), float(err[worst]), float(bound[worst]), float(ratio[worst]),
        baseline, nan, worst,
    )  # fmt: skip


def _diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|, zero where both are the same infinity."""
    return torch.where(a == b, 0.0, (a - b).abs())


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def judge_outputs(
    case: Case,
    inputs: Inputs,
    got: Mapping[str, torch.Tensor],
) -> list[Verdict]:
    """Judge ``got`` (out and gradients of one run on ``inputs``) by the rule.

    Computes the float64 reference, the plain run in the case's dtype and the
    magnitudes itself.
    """
    ref = outputs_and_grads(_REFERENCE, case, inputs, torch.float64)
    plain = outputs_and_grads(_PLAIN, case, inputs, case.dtype)
    floors = case_floors(case, inputs)
    return [judge(name, got[name], r, floors[name], _get(plain, name)) for name, r in ref.items()]


def case_floors(case: Case, inputs: Inputs) -> dict[str, torch.Tensor]:
    """The rule's floor (`rounding_floor`) of each quantity of the case, shaped like it."""
    q, k, v, dout = (_tensor(inputs, n) for n in ("q", "k", "v", "dout"))
    mags, sens = magnitudes(
        q, k, v, dout, inputs["mask"], unit_roundoff=unit_roundoff(case.dtype),
        sinks=inputs.get("sinks"), **_reference_keywords(q, k, case.kwargs),  # type: ignore[arg-type]
    )  # fmt: skip
    n, operands, d = terms(case), operand_scale(case, inputs), case.shapes.head_dim
    return {
        name: rounding_floor(mags[name], sens[name], case.dtype, n, d, operands) for name in mags
    }


def operand_scale(case: Case, inputs: Inputs) -> float:
    """max(1, scale) times max(1, max|t|) for t in q, k, v, dout: what an underflow meets."""
    scale = case.scale if case.scale is not None else 1 / math.sqrt(case.shapes.head_dim)
    largest = (_max(_tensor(inputs, n).detach().abs()) for n in ("q", "k", "v", "dout"))
    return float(math.prod(max(1.0, x) for x in largest)) * max(1.0, abs(scale))


def _get(results: Mapping[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    return None if results is None else results[name]


def _tensor(inputs: Inputs, name: str) -> torch.Tensor:
    t = inputs[name]
    assert t is not None
    return t


@dataclass
class CaseResult:
    """Errors and verdicts of one strategy on one case (JSON-ready via `as_dict`)."""

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

    @property
    def derivatives_passed(self) -> bool | None:
        """Both higher-derivative errors within `DERIVATIVE_TOLERANCE`; None when not run."""
        errors = [e for e in (self.second_order_error, self.jvp_error) if e is not None]
        return all(e <= DERIVATIVE_TOLERANCE for e in errors) if errors else None

    @property
    def passed(self) -> bool:
        return (
            self.rule_passed
            and not self.nan
            and self.gradcheck_passed is not False
            and self.derivatives_passed is not False
            and self.gradgradcheck_passed is not False
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def default_cases() -> list[Case]:
    """The grid `attngrad check` runs: every dtype x mask kind x layout.

    Odd sizes on purpose (33, 47, 59) so no tile or vector width divides them.
    """
    layouts = [
        Shapes((2,), 2, 2, 33, 33, 16, 16),
        # GQA with Nq != Nk and a value dim unlike the query/key dim
        Shapes((1,), 4, 2, 17, 47, 59, 24),
        # the course chapter's [B, N, d] layout (no leading dims) and two leading dims
        Shapes((), 3, 3, 97, 97, 8, 8),
        # one key: P = 1 and dS = 0 exactly in plain math
        Shapes((2, 2), 2, 1, 7, 1, 8, 8),
    ]
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    grid = [
        Case(layout, dtype, mask) for dtype in dtypes for mask in MASK_KINDS for layout in layouts
    ]
    return grid + _feature_cases(layouts[0], layouts[1])


def _feature_cases(square: Shapes, wide: Shapes) -> list[Case]:
    """Attention beyond SDPA's options, each on its own, in float64 and float32, then all in bfloat16.

    square: Nq = Nk; wide: GQA with Nq < Nk.  Dropout at p = 0.2 (and p = 1:
    all zeros) checks that every strategy draws the reference's one mask.
    Bottom-right alignment with Nq > Nk leaves the first Nq - Nk rows dead;
    the packed cases have an empty key segment (its queries attend nothing).
    """
    tall = Shapes((2,), 2, 2, 29, 13, 16, 16)
    packed = Shapes((1,), 2, 2, 33, 47, 16, 16)
    f64, f32 = torch.float64, torch.float32
    both = [
        Case(square, mask="float", dropout=0.2),
        Case(square, mask="float", softcap=1.5),
        Case(square, mask="bool", sinks="token"),  # with make_inputs' dead row
        Case(tall, mask="causal", align="bottom-right"),
    ]
    return [
        *(replace(c, dtype=dtype) for dtype in (f64, f32) for c in both),
        Case(wide, f64, "causal", dropout=1.0),
        Case(wide, f64, sinks="head"),
        Case(wide, f64, "causal", align="bottom-right"),
        Case(wide, f64, window=(8, 2), align="bottom-right"),
        Case(packed, f64, "causal", align="bottom-right", segments=((10, 7, 16), (20, 0, 27))),
        # and an empty query segment: keys 9-15 are attended by no query
        Case(replace(packed, seq_k=33), f32, "causal", segments=((12, 0, 9, 12), (9, 7, 0, 17))),
        # everything at once: causal as the window (None, 0), beside a float mask
        Case(
            wide, torch.bfloat16, "float", window=(None, 0), align="bottom-right",
            softcap=1.5, sinks="head", dropout=0.2,
        ),
    ]  # fmt: skip


def _default_mask_shape(case: Case) -> tuple[int, ...]:
    """ "bool": shared across heads [*lead, 1, Nq, Nk]; "float": shared across the batch."""
    sh = case.shapes
    if case.mask == "bool":
        return (*sh.lead, 1, sh.seq_q, sh.seq_k)
    return (sh.heads_q, sh.seq_q, sh.seq_k)


def make_inputs(case: Case, seed: int = 0, dead_row: bool = True) -> Inputs:
    """float64 q, k, v, mask, sinks and an upstream gradient dout for the case, from ``seed``.

    Every dtype sees the same numbers (cast later).  A bool mask keeps about
    70% of the scores; a float mask is standard normal.  ``dead_row``: query
    row 1 of a bool mask attends nothing (-inf everywhere in a float mask is
    left to the tests that want it).  Sinks ([Hq] per head, [*lead, Hq, Nq]
    per token; None without) are normal around log Nk, so a sink takes
    about half of each row.
    """
    gen = torch.Generator().manual_seed(seed)
    sh = case.shapes

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs: Inputs = {
        "q": randn(*sh.lead, sh.heads_q, sh.seq_q, sh.head_dim),
        "k": randn(*sh.lead, sh.heads_kv, sh.seq_k, sh.head_dim),
        "v": randn(*sh.lead, sh.heads_kv, sh.seq_k, sh.value_dim),
        "mask": None,
        "dout": randn(*sh.lead, sh.heads_q, sh.seq_q, sh.value_dim),
    }
    shape = case.mask_shape or _default_mask_shape(case)
    if case.mask == "bool":
        keep = torch.rand(*shape, generator=gen, dtype=torch.float64) > 0.3
        if dead_row and len(shape) >= 2 and shape[-2] > 1:
            keep[..., 1, :] = False
        inputs["mask"] = keep
    elif case.mask == "float":
        inputs["mask"] = randn(*shape)
    sinks = {"none": None, "head": (sh.heads_q,), "token": (*sh.lead, sh.heads_q, sh.seq_q)}
    sink_shape = sinks[case.sinks]
    inputs["sinks"] = None if sink_shape is None else randn(*sink_shape) + math.log(sh.seq_k)
    return inputs


def outputs_and_grads(
    fn: AttentionFn, case: Case, inputs: Inputs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Run ``fn`` SDPA-style on fresh leaves cast to ``dtype``: out and every gradient.

    A float mask and sinks are leaves too (their gradients are "dmask" and
    "dsinks").  Results keep ``fn``'s dtype and are detached.
    """
    leaves = _differentiable(inputs, dtype)
    out = _call(fn, case, inputs, leaves)
    grads = torch.autograd.grad(out, list(leaves.values()), _tensor(inputs, "dout").to(dtype))
    return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


def _gradcheck(fn: AttentionFn, case: Case, inputs: Inputs) -> bool:
    """``torch.autograd.gradcheck`` (fast mode) of ``fn`` at the case's float64 inputs.

    Each call gets the case's keywords afresh, so a dropout case's generator
    is re-made there and every call draws the same mask.
    """
    x = _differentiable(inputs)
    names = list(x)

    def call(*a: torch.Tensor) -> torch.Tensor:
        return _call(fn, case, inputs, dict(zip(names, a, strict=True)))

    try:
        return bool(torch.autograd.gradcheck(call, tuple(x.values()), fast_mode=True))
    except GradcheckError:
        return False


def _differentiable(inputs: Inputs, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Fresh leaves in ``dtype`` of what attention is differentiated in: q, k, v, a float mask, sinks."""
    names = ["q", "k", "v"]
    mask = inputs["mask"]
    if mask is not None and mask.dtype != torch.bool:
        names.append("mask")
    if inputs.get("sinks") is not None:
        names.append("sinks")
    return {n: _tensor(inputs, n).detach().to(dtype).clone().requires_grad_() for n in names}


def _call(
    fn: AttentionFn, case: Case, inputs: Inputs, x: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``fn`` SDPA-style on x's q, k, v, mask and sinks (a bool mask, not differentiable, from inputs).

    The case's keywords are made afresh (a dropout case's generator with them).
    """
    mask = x.get("mask", inputs["mask"])
    sinks = {"sinks": x["sinks"]} if "sinks" in x else {}
    return fn(x["q"], x["k"], x["v"], mask, **sinks, **case.kwargs)


def directions(inputs: Inputs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed random float64 directions u, one like each of q, k, v, a float mask and sinks.

    Drawn from ``seed``.

    They are the cotangents of the first-order gradients in `second_order` and the
    tangents in `output_tangent`; standard normal, drawn apart from `make_inputs`'.
    """
    gen = torch.Generator().manual_seed(seed + 0x5EC0D)
    return {
        n: torch.randn(t.shape, generator=gen, dtype=torch.float64)
        for n, t in _differentiable(inputs).items()
    }


def second_order(
    fn: AttentionFn, case: Case, inputs: Inputs, u: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Double backward of ``fn`` in float64: H = grad(sum_i <g_i, u_i>, x), detached.

    x = (q, k, v[, mask][, sinks], dout) as float64 leaves, g = grad(<O, dout>, x minus
    dout, create_graph=True), u: `directions` (q, k, v[, mask][, sinks] shapes).  Keys "q",
    "k", "v", ("mask"), ("sinks") and "dout": H's part for each (the Hessian-vector
    product H_dout u in q, k, v, mask, sinks; J u in dout), shaped like it.  A part autograd leaves
    unconnected is zero.
    """
    x = _differentiable(inputs)
    dout = _tensor(inputs, "dout").detach().double().clone().requires_grad_()
    out = _call(fn, case, inputs, x)
    g = torch.autograd.grad(out, list(x.values()), dout, create_graph=True)
    inner = sum((gi * u[n]).sum() for gi, n in zip(g, x, strict=True))
    wrt = [*x.values(), dout]
    h = torch.autograd.grad(inner, wrt, allow_unused=True)  # type: ignore[arg-type]
    names = [*x, "dout"]
    return {
        n: torch.zeros_like(t) if hi is None else hi.detach()
        for n, t, hi in zip(names, wrt, h, strict=True)
    }


def output_tangent(
    fn: AttentionFn, case: Case, inputs: Inputs, u: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Forward mode of ``fn`` in float64: dO [*lead, Hq, Nq, dv] along tangents ``u``.

    ``torch.func.jvp`` at (q, k, v[, mask][, sinks]) from ``inputs`` with tangents u
    (`directions`); a bool mask is held fixed.
    """
    x = _differentiable(inputs)
    names = list(x)

    def call(*primals: torch.Tensor) -> torch.Tensor:
        return _call(fn, case, inputs, dict(zip(names, primals, strict=True)))

    primals = tuple(x[n].detach() for n in names)
    tangent = torch.func.jvp(call, primals, tuple(u[n] for n in names))[1]
    return tangent.detach()  # type: ignore[no-any-return]


def relative_error(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    """max_i max|got_i - ref_i| / max(1, max_i max|ref_i|) over the names of ``ref``; inf on NaN.

    Each got_i is shaped like ref_i; a name missing from ``got`` or a shape that
    differs is a ValueError naming it.
    """
    missing = [n for n in ref if n not in got]
    if missing:
        raise ValueError(f"got has no {missing}; give every name of ref: {list(ref)}")
    for n, r in ref.items():
        if got[n].shape != r.shape:
            raise ValueError(
                f"got[{n!r}]: shape {tuple(got[n].shape)} differs from {tuple(r.shape)}"
            )
    if any(bool(got[n].isnan().any()) for n in ref):
        return math.inf
    error = max((_max(_diff(got[n].double(), r.double())) for n, r in ref.items()), default=0.0)
    magnitude = max((_max(r.double().abs()) for r in ref.values()), default=0.0)
    return error / max(1.0, magnitude)


def derivative_errors(
    fn: AttentionFn, case: Case, inputs: Inputs, seed: int = 0
) -> tuple[dict[str, float], list[str]]:
    """({"second_order": e, "jvp": e}, messages) of ``fn`` against the reference in float64.

    e: `relative_error` of `second_order` and `output_tangent` along the same
    `directions`; a derivative that raises gets e = inf and a message naming it,
    one over `DERIVATIVE_TOLERANCE` a message with its error.
    """
    u = directions(inputs, seed)
    runs: dict[str, Callable[[AttentionFn], Mapping[str, torch.Tensor]]] = {
        "second_order": lambda f: second_order(f, case, inputs, u),
        "jvp": lambda f: {"out": output_tangent(f, case, inputs, u)},
    }
    errors: dict[str, float] = {}
    messages: list[str] = []
    for name, run in runs.items():
        ref = run(_REFERENCE)
        try:
            errors[name] = relative_error(run(fn), ref)
        except Exception as exc:  # a derivative that cannot run fails the case, with its message
            errors[name] = math.inf
            messages.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not errors[name] <= DERIVATIVE_TOLERANCE:
            messages.append(f"{name}: relative error {errors[name]:.3g} > {DERIVATIVE_TOLERANCE:g}")
    return errors, messages


def _gradgradcheck(fn: AttentionFn, case: Case, inputs: Inputs) -> bool:
    """``torch.autograd.gradgradcheck`` (fast mode) of ``fn`` at the case's float64 inputs."""
    x = _differentiable(inputs)
    names = list(x)

    def call(*a: torch.Tensor) -> torch.Tensor:
        return _call(fn, case, inputs, dict(zip(names, a, strict=True)))

    dout = _tensor(inputs, "dout").detach().double().clone().requires_grad_()
    try:
        return bool(torch.autograd.gradgradcheck(call, tuple(x.values()), (dout,), fast_mode=True))
    except GradcheckError:
        return False


def _elements(inputs: Inputs) -> int:
    """Elements of q, k, v, dout and a float mask: the size gradgradcheck perturbs."""
    return (
        sum(t.numel() for t in _differentiable(inputs).values()) + _tensor(inputs, "dout").numel()
    )


def strategy_fn(strategy: str) -> AttentionFn:
    """`attention` bound to one strategy."""

    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return attention(*args, strategy=strategy, **kwargs)  # type: ignore[arg-type,call-overload,no-any-return]

    return fn


def run_case(
    strategy: str,
    case: Case,
    seed: int = 0,
    gradcheck: bool = True,
    fn: AttentionFn | None = None,
    derivatives: bool = True,
    gradgradcheck: bool | None = None,
) -> CaseResult:
    """Judge one strategy (or any SDPA-like ``fn``) on one case.

    float64 cases also get ``gradcheck`` (when ``gradcheck``), the higher
    derivatives (when ``derivatives``: `derivative_errors`) and, when they ran,
    gradgradcheck on cases of at most `GRADGRADCHECK_ELEMENTS` input elements
    (``gradgradcheck`` None: with gradcheck, except for `SLOW_GRADGRADCHECK`).
    """
    if gradgradcheck is None:
        gradgradcheck = gradcheck and strategy not in SLOW_GRADGRADCHECK
    fn = fn or strategy_fn(strategy)
    inputs = make_inputs(case, seed)
    result = CaseResult(
        strategy=strategy, case=case.id, dtype=str(case.dtype).removeprefix("torch.")
    )
    try:
        got = outputs_and_grads(fn, case, inputs, case.dtype)
    except Exception as exc:  # a crash is a failed case, reported with its message
        result.message = f"{type(exc).__name__}: {exc}"
        return result
    verdicts = judge_outputs(case, inputs, got)
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
        result.gradcheck_passed = _gradcheck(fn, case, inputs)
        failures.append("" if result.gradcheck_passed else "gradcheck failed")
    if derivatives:
        errors, messages = derivative_errors(fn, case, inputs, seed)
        result.second_order_error, result.jvp_error = errors["second_order"], errors["jvp"]
        failures += messages
    ran = derivatives and math.isfinite(result.second_order_error or 0.0)  # else failed above
    if gradgradcheck and ran and _elements(inputs) <= GRADGRADCHECK_ELEMENTS:
        result.gradgradcheck_passed = _gradgradcheck(fn, case, inputs)
        failures.append("" if result.gradgradcheck_passed else "gradgradcheck failed")
    result.message = "; ".join(filter(None, failures))
    return result


def format_error(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1e}"
