r"""Judge any function with SDPA's signature: ``attngrad verify MODULE:FUNCTION``.

``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
scale=None, enable_gqa=False)``: a user's Triton or CUDA kernel, xformers, a
teaching implementation.  `verify` runs, in order:

1. Feature discovery (`FEATURES`).  One probe per feature: forward and
   backward on the simplest small case that has that feature and nothing
   else (the base: float32, or the first dtype the function takes).  A probe
   that raises ``NotImplementedError``, ``RuntimeError``, ``ValueError``,
   ``TypeError`` or ``AssertionError`` means the function refuses the
   feature: "unsupported", and every grid case with it is reported
   unsupported (``passed`` None), not failed.  Any other exception on a probe
   is a crash: the feature's check fails and its cases run anyway.  A probe
   never judges numbers; a supported feature whose numbers are wrong, or
   that raises on a larger case of the grid, fails there.  "float mask
   gradient": a float mask whose gradient the function does not give (the
   backward raises, or the mask is not in the graph) is unsupported; its
   cases then judge out, dq, dk and dv only.
2. The conformance grid: `attngrad.verify.cases.default_cases` restricted to SDPA's
   options (no softcap, sinks, packed segments, window, bottom-right
   alignment or dropout: attngrad's extensions), each judged against the
   float64 reference by `attngrad.verify.rule` (at most 2x plain PyTorch's
   error in the same dtype, or a fused kernel's 16-bit products' if larger,
   plus a floor derived from the computation), and the long 16-bit cases
   (`attngrad.verify.cases.long_cases`) that span several tiles.
3. ``gradcheck`` (fast mode) on each float64 case the function takes.
4. Determinism: forward and backward `DETERMINISM_RUNS` times on one case
   (GQA, Nq != Nk, a float mask where supported) must agree bit for bit.
5. No input modified: the values and ``_version`` of q, k, v and the mask,
   after every grid case (inputs that require grad) and after one call
   without grad.

`Result.passed`: every case and check that ran passed (unsupported ones are
left out; a function that supports nothing fails).

``flex=True`` judges a function with FlexAttention's signature instead,
``fn(query, key, value, score_mod=None, block_mask=None, scale=None,
enable_gqa=False)`` (torch's ``flex_attention``, ``attngrad.flex_attention``, a
user's kernel), on `attngrad.verify.cases.flex_cases` (score functions,
captured tensors and BlockMasks, in every dtype).  Its probes
(`FLEX_FEATURES`) take the dtypes forward only, then ask for ``backward``:
a function whose backward is refused (torch's CPU flex_attention raises on
inputs that require grad) is judged on its output alone, its cases marked
"forward only", gradcheck not run, and "backward" reported unsupported.  A
function that runs a score function but gives no gradient for the tensor
it reads ("captured gradient") is judged without dtheta.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.autograd.gradcheck import GradcheckError

from attngrad.core.contract import DTYPES, Shapes, dtype_name
from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    call_case,
    default_cases,
    flex_cases,
    input_tensor,
    long_cases,
    make_inputs,
    make_leaves,
)
from attngrad.verify.flex_cases import scenario
from attngrad.verify.rule import Expected, expect, judge_run

__all__ = [
    "DETERMINISM_RUNS",
    "FEATURES",
    "FLEX_FEATURES",
    "REFUSALS",
    "CaseReport",
    "Check",
    "Result",
    "case_features",
    "flex_signature",
    "load",
    "quick_cases",
    "quick_flex_cases",
    "sdpa_cases",
    "verify",
]

Step = Callable[[str], None]

DTYPE_FEATURES = ("float32", "float64", "bfloat16", "float16")
# the features a probe asks about, besides the dtypes
SHAPE_FEATURES = (
    "bool mask", "float mask", "float mask gradient", "causal", "gqa", "nq!=nk", "dv!=d",
    "3-d inputs", "5-d inputs",
)  # fmt: skip
FEATURES = (*DTYPE_FEATURES, *SHAPE_FEATURES)
# a FlexAttention-signature function's (``flex=True``): the dtypes are probed forward only
FLEX_SHAPE_FEATURES = (
    "backward", "score_mod", "captured gradient", "block_mask", "gqa", "nq!=nk", "dv!=d",
)  # fmt: skip
FLEX_FEATURES = (*DTYPE_FEATURES, *FLEX_SHAPE_FEATURES)
# what a function raises to say "I don't do this" (on a probe only)
REFUSALS: tuple[type[BaseException], ...] = (
    NotImplementedError, RuntimeError, ValueError, TypeError, AssertionError,
)  # fmt: skip
DETERMINISM_RUNS = 5
_BASE = Shapes((1,), 2, 2, 5, 5, 4, 4)
# a flex probe's: long enough for a BlockMask of two blocks in each direction
_FLEX_BASE = Shapes((1,), 2, 2, 20, 20, 8, 8)
# the simplest flex case of each feature (`_probe_case`): a scenario of attngrad.verify.flex_cases
_FLEX_PROBES = {"score_mod": "softcap", "captured gradient": "relative", "block_mask": "sliding"}


# ---------------------------------------------------------------------------- load


def load(spec: str) -> AttentionFn:
    """The function named by ``spec``: ``pkg.mod:func`` or ``path/to/file.py:func``.

    ``func`` may be dotted (``mod:Class.method``).  A malformed spec or a
    function that is not callable is a ValueError, a module or attribute that
    cannot be found an ImportError; each names the spec and the forms.
    """
    forms = (
        "give MODULE:FUNCTION, e.g. torch.nn.functional:scaled_dot_product_attention "
        "or path/to/file.py:my_attention"
    )
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"cannot read {spec!r} as a function: {forms}")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        obj: object = _load_file(spec, module_name, forms)
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise ImportError(
                f"{spec!r}: cannot import module {module_name!r} ({e}); {forms}"
            ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(
                f"{spec!r}: {module_name!r} has no attribute {attr!r}; {forms}"
            ) from e
    if not callable(obj):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a function; {forms}")
    return obj  # type: ignore[return-value]


def flex_signature(fn: object) -> bool:
    """Whether ``fn`` reads as FlexAttention-signature: it names a ``score_mod`` or
    ``block_mask`` parameter (torch's flex_attention, attngrad's, a kernel written after
    them).  False where the signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return "score_mod" in params or "block_mask" in params


def _load_file(spec: str, path: str, forms: str) -> object:
    if not os.path.isfile(path):
        raise ImportError(f"{spec!r}: no file {path!r}; {forms}")
    name = "_attngrad_verify_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{spec!r}: cannot load {path!r} as a Python file; {forms}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- cases


def sdpa_cases() -> list[Case]:
    """`default_cases` restricted to SDPA's options (what `verify` runs by default)."""
    return [
        c
        for c in default_cases()
        if c.flex is None
        and c.softcap is None
        and c.sinks == "none"
        and c.align == "top-left"
        and c.segments is None
        and c.window is None
        and not c.dropout
        and c.scale is None
    ]


def quick_cases() -> list[Case]:
    """A small grid for tests: every mask kind on the square and the GQA layout in float64
    and float32, and the GQA layout in bfloat16 and float16 (no long case)."""
    keep = []
    for c in sdpa_cases():
        if c in long_cases():
            continue
        gqa = c.shapes.heads_q != c.shapes.heads_kv and c.shapes.seq_k > 1
        square = c.shapes.lead == (2,) and c.shapes.seq_q == c.shapes.seq_k
        if gqa or (square and c.dtype in (torch.float64, torch.float32)):
            keep.append(c)
    return keep


def quick_flex_cases() -> list[Case]:
    """A small flex grid for tests: every scenario in float32, and those with a score function
    in bfloat16 too."""
    return [
        c
        for c in flex_cases()
        if c.dtype == torch.float32 or (c.dtype == torch.bfloat16 and scenario(c.flex or "").score)
    ]


def case_features(case: Case) -> list[str]:
    """What a case exercises: its dtype, mask kind and layout (``dead rows``: a bool mask
    with a query row that attends nothing; ``nk=1``: a single key); a flex case's score
    function, captured tensor and BlockMask."""
    sh = case.shapes
    features = [dtype_name(case.dtype)]
    if case.flex is not None:
        s = scenario(case.flex)
        features += ["score_mod"] if s.score is not None else []
        features += ["captured gradient"] if s.theta is not None else []
        features += ["block_mask"] if s.mask is not None else []
        features += ["dead rows"] if s.name == "empty-rows" else []
    elif case.mask == "bool":
        features.append("bool mask")
        if sh.seq_q > 1:
            features.append("dead rows")
    elif case.mask == "float":
        features += ["float mask", "float mask gradient"]
    elif case.mask == "causal":
        features.append("causal")
    if sh.heads_q != sh.heads_kv:
        features.append("gqa")
    if sh.seq_q != sh.seq_k:
        features.append("nq!=nk")
    if sh.seq_k == 1:
        features.append("nk=1")
    if sh.head_dim != sh.value_dim:
        features.append("dv!=d")
    if len(sh.lead) == 0:
        features.append("3-d inputs")
    elif len(sh.lead) >= 2:
        features.append("5-d inputs")
    return features


def _probe_case(feature: str, dtype: torch.dtype, flex: bool = False) -> Case:
    """The simplest case with ``feature`` and nothing else (a flex_attention call with
    ``flex``)."""
    if flex:
        shapes = {
            "gqa": replace(_FLEX_BASE, heads_q=4),
            "nq!=nk": replace(_FLEX_BASE, seq_k=28),
            "dv!=d": replace(_FLEX_BASE, value_dim=12),
        }
        return Case(
            shapes.get(feature, _FLEX_BASE), DTYPES.get(feature, dtype),
            flex=_FLEX_PROBES.get(feature, "none"),
        )  # fmt: skip
    if feature in DTYPES:
        return Case(_BASE, DTYPES[feature])
    masks = {"bool mask": "bool", "float mask": "float", "float mask gradient": "float"}
    shapes = {
        "gqa": replace(_BASE, heads_q=4),
        "nq!=nk": replace(_BASE, seq_k=7),
        "dv!=d": replace(_BASE, value_dim=6),
        "3-d inputs": replace(_BASE, lead=()),
        "5-d inputs": replace(_BASE, lead=(1, 2)),
    }
    mask = "causal" if feature == "causal" else masks.get(feature, "none")
    return Case(shapes.get(feature, _BASE), dtype, mask)


# -------------------------------------------------------------------------- results


@dataclass
class CaseReport:
    """One grid case: ``passed`` None when a feature it needs is unsupported."""

    id: str
    features: list[str]
    passed: bool | None
    errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    message: str = ""
    # error / bound at each quantity's worst element (<= 1 passes; the rule is element-wise,
    # so errors[n] / bounds[n] is not this: errors is the max error, bounds the worst one's)
    ratios: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for key in ("errors", "bounds", "ratios"):
            d[key] = {k: _json_number(x) for k, x in getattr(self, key).items()}
        return d


@dataclass
class Check:
    """One check beside the grid; ``passed`` None: not run (a feature it needs is unsupported)."""

    name: str
    passed: bool | None
    message: str = ""


@dataclass
class Result:
    """Everything `verify` found; ``unsupported``: feature -> what the probe raised."""

    cases: list[CaseReport]
    checks: list[Check]
    unsupported: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        verdicts = [c.passed for c in self.cases] + [c.passed for c in self.checks]
        return any(c.passed for c in self.cases) and all(v for v in verdicts if v is not None)

    def as_dict(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "unsupported": self.unsupported,
            "cases": [c.as_dict() for c in self.cases],
            "checks": [asdict(c) for c in self.checks],
        }


def _json_number(x: float) -> float | str:
    """JSON has no NaN or infinity: those become the strings "nan", "inf"."""
    return x if math.isfinite(x) else str(x)


# ------------------------------------------------------------------------- running


@dataclass(frozen=True)
class _Takes:
    """What the function gives beyond out, dq, dk, dv: dmask (``mask_grad``), dtheta
    (``theta_grad``), any gradient at all (``backward``; False: judged forward only)."""

    mask_grad: bool = True
    theta_grad: bool = True
    backward: bool = True

    def leaves(self, case: Case, inputs: Inputs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`make_leaves` of what it is differentiated in; forward only: the same tensors
        without requires_grad (a kernel without backward may refuse inputs that require grad)."""
        dtypes = case.input_dtypes(dtype)
        leaves = make_leaves(inputs, dtype, self.mask_grad, self.theta_grad, dtypes)
        return leaves if self.backward else {n: t.detach() for n, t in leaves.items()}


def _fixed(
    case: Case, inputs: Inputs, leaves: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The mask and a flex case's theta where they are not leaves: fresh copies in ``dtype``
    (theta in its own, `attngrad.verify.cases.Case.input_dtypes`; a bool mask as it is)."""
    fixed = {}
    dtypes = case.input_dtypes(dtype)
    for name in ("mask", "theta"):
        t = inputs.get(name)
        if t is not None and name not in leaves:
            own = dtypes.get(name, dtype)
            fixed[name] = t.clone() if t.dtype == torch.bool else t.to(own).clone()
    return fixed


class _Modified(Exception):
    """An input the function changed (value or ``_version``)."""


def _run(fn: AttentionFn, case: Case, inputs: Inputs, takes: _Takes) -> dict[str, torch.Tensor]:
    """out and the gradients of q, k, v (and the mask, theta) of ``fn`` on the case, in its
    dtype (out alone when ``takes.backward`` is False).

    Raises `_Modified` naming each input whose value or ``_version`` changed.
    """
    dtype = case.dtype
    leaves = takes.leaves(case, inputs, dtype)
    given = {**leaves, **_fixed(case, inputs, leaves, dtype)}
    before = {n: (t.detach().clone(), t._version) for n, t in given.items()}
    with torch.set_grad_enabled(takes.backward):
        out = call_case(fn, case, inputs, given)
    # before backward too: autograd refuses a backward whose saved inputs were modified
    changed = [n for n, (value, version) in before.items() if _changed(given[n], value, version)]
    if changed:
        raise _Modified(f"{', '.join(changed)} modified in place by the call")
    if not takes.backward:
        return {"out": out.detach()}
    dout = input_tensor(inputs, "dout").to(out.dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), dout, allow_unused=True)
    changed = [n for n, (value, version) in before.items() if _changed(given[n], value, version)]
    if changed:
        raise _Modified(f"{', '.join(changed)} modified in place by the backward")
    missing = [n for n, g in zip(leaves, grads, strict=True) if g is None]
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)} (not in the graph)")
    result = {"out": out.detach()}
    result.update({"d" + n: g for n, g in zip(leaves, grads, strict=True) if g is not None})
    return result


def _changed(t: torch.Tensor, value: torch.Tensor, version: int) -> bool:
    return t._version != version or not _same_bits(t.detach(), value)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equals NaN of the same bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _probe(
    fn: AttentionFn, feature: str, dtype: torch.dtype, seed: int, flex: bool = False,
    backward: bool = True,
) -> tuple[bool | None, str]:  # fmt: skip
    """(True, "") supported; (None, why) refused; (False, why) crashed.  ``backward`` False:
    forward only."""
    case = _probe_case(feature, dtype, flex)
    inputs = make_inputs(case, seed, dead_row=False)
    takes = _Takes(feature == "float mask gradient", feature == "captured gradient", backward)
    try:
        got = _run(fn, case, inputs, takes)
    except _Modified:
        return True, ""  # the no-modification check reports it
    except REFUSALS as e:
        return None, _error(e)
    except Exception as e:  # any other exception on the simplest case is a crash
        return False, _error(e)
    if feature == "float mask gradient" and "dmask" not in got:
        return None, "no gradient for the float mask"
    if feature == "captured gradient" and backward and "dtheta" not in got:
        return None, "no gradient for the tensor the score function reads"
    return True, ""


def _grid_case(
    fn: AttentionFn,
    case: Case,
    seed: int,
    takes: _Takes,
    modified: list[str],
    expected: Expected | None,
) -> CaseReport:
    features = case_features(case)
    if case.mask == "float" and not takes.mask_grad:
        features.remove("float mask gradient")
    if "captured gradient" in features and not (takes.theta_grad and takes.backward):
        features.remove("captured gradient")
    report = CaseReport(case.id, features, False)
    inputs = make_inputs(case, seed) if expected is None else expected.inputs
    try:
        got = _run(fn, case, inputs, takes)
    except _Modified as e:
        modified.append(f"{case.id}: {e}")
        report.message = f"{_names(features)}: {e}"
        return report
    except Exception as e:  # a crash on a supported feature fails the case
        report.message = f"{_names(features)}: raised {_error(e)}"
        return report
    try:
        verdicts = judge_run(expected or expect(case, inputs), got, names=got.keys())
    except ValueError as e:  # a shape that differs from the reference's
        report.message = f"{_names(features)}: {e}"
        return report
    for v in verdicts:
        report.errors[v.name] = math.nan if v.nan else v.error
        report.bounds[v.name] = v.bound
        report.ratios[v.name] = math.inf if v.nan else v.ratio
    report.passed = all(v.passed for v in verdicts)
    failed = [str(v) for v in verdicts if not v.passed]
    if failed:
        report.message = f"{_names(features)}: " + "; ".join(failed)
    if case.mask == "float" and not takes.mask_grad:
        report.message = "; ".join(filter(None, [report.message, "dmask not judged"]))
    if not takes.backward:
        report.message = "; ".join(filter(None, [report.message, "forward only (no backward)"]))
    elif case.flex is not None and scenario(case.flex).theta is not None and not takes.theta_grad:
        report.message = "; ".join(filter(None, [report.message, "dtheta not judged"]))
    return report


def _names(features: Sequence[str]) -> str:
    return "[" + ", ".join(features) + "]"


class _SlowMode(Exception):
    """gradcheck went on to its slow mode: fast mode failed (slow mode only builds the message)."""


# fast mode evaluates the function a few times per input; on a mismatch gradcheck then
# rebuilds the whole Jacobian column by column (2 calls per input element) for its message,
# minutes on the grid's cases: past this many calls the check has failed and stops
_GRADCHECK_CALLS = 64


def _gradcheck(fn: AttentionFn, case: Case, seed: int, takes: _Takes) -> str:
    """ "" when gradcheck (fast mode) passes on the float64 case, else what failed."""
    inputs = make_inputs(case, seed)
    leaves = takes.leaves(case, inputs, torch.float64)
    names = list(leaves)
    fixed = _fixed(case, inputs, leaves, torch.float64)

    calls = 0

    def call(*a: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > _GRADCHECK_CALLS:
            raise _SlowMode
        return call_case(fn, case, inputs, {**dict(zip(names, a, strict=True)), **fixed})

    try:
        torch.autograd.gradcheck(call, tuple(leaves.values()), fast_mode=True)
    except (GradcheckError, _SlowMode):
        return f"{case.id}: the Jacobian differs from finite differences"
    except Exception as e:  # a crash fails gradcheck
        return f"{case.id}: raised {_error(e)}"
    return ""


def _determinism(fn: AttentionFn, case: Case, seed: int, takes: _Takes) -> Check:
    what = "forward+backward" if takes.backward else "forward"
    name = f"determinism ({DETERMINISM_RUNS} {what} runs, bit for bit)"
    inputs = make_inputs(case, seed)
    try:
        runs = [_run(fn, case, inputs, takes) for _ in range(DETERMINISM_RUNS)]
    except Exception as e:  # reported, not raised: the grid names the case too
        return Check(name, False, f"{case.id}: raised {_error(e)}")
    differ = sorted({n for r in runs[1:] for n, t in r.items() if not _same_bits(t, runs[0][n])})
    if differ:
        return Check(name, False, f"{case.id}: {', '.join(differ)} differ between runs")
    return Check(name, True, case.id)


def _no_grad_call(fn: AttentionFn, case: Case, seed: int) -> str:
    """ "" when a call without grad leaves q, k, v, the mask and theta alone, else which it
    changed."""
    inputs = make_inputs(case, seed)
    given = {n: input_tensor(inputs, n).to(case.dtype).clone() for n in ("q", "k", "v")}
    given.update(_fixed(case, inputs, given, case.dtype))
    before = {n: (t.clone(), t._version) for n, t in given.items()}
    try:
        with torch.no_grad():
            call_case(fn, case, inputs, given)
    except Exception as e:  # reported by the check
        return f"{case.id} without grad: raised {_error(e)}"
    changed = [n for n, (value, version) in before.items() if _changed(given[n], value, version)]
    return f"{case.id} without grad: {', '.join(changed)} modified in place" if changed else ""


def verify(
    fn: AttentionFn,
    progress: Step | None = None,
    cases: Sequence[Case] | None = None,
    seed: int = 0,
    gradcheck: bool = True,
    expected: Callable[[Case], Expected] | None = None,
    flex: bool = False,
) -> Result:
    """Judge ``fn`` (SDPA's signature; FlexAttention's with ``flex``) as the module docstring
    says.

    cases: the grid (default `sdpa_cases`, with ``flex`` `attngrad.verify.cases.flex_cases`;
    `quick_cases`, `quick_flex_cases` for a small one);
    progress: called with a note after each probe, case and check
    (`steps` of them in all); expected: each case's expectation on ``seed``'s
    inputs (`attngrad.verify.check.expect_case`), a cache of which lets
    several functions judged on one grid share it (None: computed here).
    """
    step = progress or (lambda note: None)
    if cases is None:
        cases = flex_cases() if flex else sdpa_cases()
    cases = list(cases)
    checks: list[Check] = []
    unsupported: dict[str, str] = {}
    status: dict[str, bool | None] = {}

    def record(feature: str, ok: bool | None, why: str) -> None:
        status[feature] = ok
        if ok is None:
            unsupported[feature] = why
        if ok is not True:
            word = "unsupported" if ok is None else "crashed"
            checks.append(Check(f"feature {feature}", ok, f"{word}: {why}"))
        step(f"probe {feature}")

    for feature in DTYPE_FEATURES:  # a flex function's forward only: backward is a feature
        record(feature, *_probe(fn, feature, DTYPES[feature], seed, flex, backward=not flex))
    base = next((DTYPES[f] for f in DTYPE_FEATURES if status[f]), None)
    for feature in FLEX_SHAPE_FEATURES if flex else SHAPE_FEATURES:
        backward = status.get("backward", True) is True
        if base is None:
            record(feature, None, "no dtype runs")
        elif feature == "float mask gradient" and status["float mask"] is None:
            record(feature, None, "float masks are unsupported")
        elif feature == "captured gradient" and status["score_mod"] is None:
            record(feature, None, "score functions are unsupported")
        elif feature == "captured gradient" and not backward:
            record(feature, None, "no backward")
        else:
            record(feature, *_probe(fn, feature, base, seed, flex, backward))
    takes = _Takes(
        status.get("float mask gradient") is not None,
        status.get("captured gradient") is not None,
        status.get("backward", True) is not None,
    )
    optional = ("float mask gradient", "captured gradient", "backward")

    def runs(case: Case) -> bool:
        needed = [f for f in case_features(case) if f in status and f not in optional]
        return all(status[f] is not None for f in needed)

    reports: list[CaseReport] = []
    modified: list[str] = []
    for case in cases:
        if runs(case):
            shared = None if expected is None else expected(case)
            reports.append(_grid_case(fn, case, seed, takes, modified, shared))
        else:
            features = case_features(case)
            off = [f for f in features if status.get(f, True) is None]
            reports.append(
                CaseReport(case.id, features, None, message=f"unsupported: {', '.join(off)}")
            )
        step(case.id)

    f64 = [c for c in cases if c.dtype == torch.float64 and runs(c)]
    if gradcheck and not takes.backward:
        checks.append(Check("gradcheck (float64, fast mode)", None, "no backward"))
        step("gradcheck")
    elif gradcheck:
        if f64:
            failed = [m for c in f64 if (m := _gradcheck(fn, c, seed, takes))]
            checks.append(
                Check(
                    f"gradcheck (float64, fast mode, {len(f64)} cases)",
                    not failed,
                    "; ".join(failed),
                )
            )
        else:
            checks.append(Check("gradcheck (float64, fast mode)", None, "no float64 case runs"))
        step("gradcheck")

    candidates = [c for c in cases if runs(c)]
    if base is not None and candidates:
        target = max(
            candidates,
            key=lambda c: (
                c.dtype == base,
                c.shapes.heads_q != c.shapes.heads_kv,
                c.shapes.seq_q != c.shapes.seq_k,
                c.mask == "float" or "captured gradient" in case_features(c),
                c.shapes.seq_k,
            ),
        )
        checks.append(_determinism(fn, target, seed, takes))
        no_grad = _no_grad_call(fn, target, seed)
    else:
        checks.append(Check("determinism", None, "no case runs"))
        fallback = _probe_case("float32", base or torch.float32, flex)
        no_grad = _no_grad_call(fn, replace(fallback, dtype=base or torch.float32), seed)
    step("determinism")
    problems = [
        *modified[:3],
        *([f"and {len(modified) - 3} more cases"] if len(modified) > 3 else []),
    ]
    problems += filter(None, [no_grad])
    checks.append(
        Check(
            f"no input modified (q, k, v, {'theta' if flex else 'mask'}: values and _version)",
            not problems,
            "; ".join(problems),
        )
    )
    step("no input modified")
    return Result(reports, checks, unsupported)


def steps(cases: Sequence[Case] | None = None, gradcheck: bool = True, flex: bool = False) -> int:
    """How many times `verify` calls ``progress`` (``flex``: on a FlexAttention-signature
    function)."""
    if cases is None:
        cases = flex_cases() if flex else sdpa_cases()
    return len(FLEX_FEATURES if flex else FEATURES) + len(cases) + int(gradcheck) + 2
