r"""The grader's engine: probes, reference answers and the catalogue of known mistakes.

This module runs inside the child process that `attngrad.learn.grade` starts, so it
imports nothing but the standard library and torch (importing the ``attngrad``
package costs seconds); the parent loads it by file path.

Each TODO function of the exercise is one stage.  A stage is fed the reference's
correct float64 inputs on several probes (non-square, square, batched, d != N
and d = N), so a mistake in one stage never cascades into the next.  A wrong
stage is diagnosed by running every known mistake of that stage on the same
probes: a mistake explains the learner's numbers when, on every probe, both
raise or both give the same values (to float64 rounding), and on at least one
probe both give values.  The learner's source is never read.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FUNCTION_STAGES",
    "MISTAKES",
    "STAGES",
    "Mistake",
    "child_main",
    "grade_attention",
    "grade_function",
]

Tensor = torch.Tensor
Outputs = tuple[Tensor, ...]
Fn = Callable[..., Any]

FUNCTION_STAGES = (
    "value_gradient",
    "probability_gradient",
    "softmax_backward",
    "query_key_gradients",
)
STAGES = (*FUNCTION_STAGES, "CustomAttention")
TODO_NUMBER = {name: i + 1 for i, name in enumerate(FUNCTION_STAGES)}
EPS = torch.finfo(torch.float64).eps

# (B, Nq, Nk, d, dv): non-square with d != N, square, batched, d = N, and B = 1
# (where broadcasting slips such as a lost keepdim give values instead of errors)
PROBES = (
    (2, 3, 5, 4, 6),
    (3, 5, 5, 3, 3),
    (2, 4, 4, 4, 4),
    (1, 4, 4, 4, 4),
    (1, 3, 3, 2, 5),
)


def _tr(x: Tensor) -> Tensor:
    return x.transpose(-2, -1)


def _rowsum(x: Tensor) -> Tensor:
    return x.sum(dim=-1, keepdim=True)


# ------------------------------------------------------------------ inputs per stage


def _inputs(stage: str, probe: tuple[int, ...], gen: torch.Generator) -> tuple[Any, ...]:
    b, nq, nk, d, dv = probe

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    p = torch.softmax(randn(b, nq, nk), dim=-1)
    if stage == "value_gradient":
        return (p, randn(b, nq, dv))
    if stage == "probability_gradient":
        return (randn(b, nq, dv), randn(b, nk, dv))
    if stage == "softmax_backward":
        return (p, randn(b, nq, nk))
    return (randn(b, nq, nk), randn(b, nq, d), randn(b, nk, d), 1.0 / math.sqrt(d))


# correct answers and the magnitudes their rounding error scales with
def _ref_value(p: Tensor, do: Tensor) -> Outputs:
    return (_tr(p) @ do,)


def _ref_prob(do: Tensor, v: Tensor) -> Outputs:
    return (do @ _tr(v),)


def _ref_softmax(p: Tensor, dp: Tensor) -> Outputs:
    return (p * (dp - _rowsum(p * dp)),)


def _ref_qk(ds: Tensor, q: Tensor, k: Tensor, s: float) -> Outputs:
    return (s * ds @ k, s * _tr(ds) @ q)


def _bound(stage: str, args: tuple[Any, ...]) -> float:
    """max of |A||B| (or its softmax analogue): float64 rounding error is a few eps times this."""
    a = tuple(x.abs() if isinstance(x, Tensor) else abs(x) for x in args)
    if stage == "softmax_backward":
        p, dp = a
        out: Outputs = (p * (dp + _rowsum(p * dp)),)
    else:
        out = REFERENCE[stage](*a)
    return max(float(t.max()) for t in out)


REFERENCE: dict[str, Callable[..., Outputs]] = {
    "value_gradient": _ref_value,
    "probability_gradient": _ref_prob,
    "softmax_backward": _ref_softmax,
    "query_key_gradients": _ref_qk,
}


# ------------------------------------------------------------------------ mistakes


@dataclass(frozen=True)
class Mistake:
    id: str
    stage: str
    explanation: str
    hint: str
    fn: Callable[..., Outputs]


def _m(id: str, stage: str, explanation: str, hint: str) -> Callable[[Fn], Mistake]:
    def wrap(fn: Fn) -> Mistake:
        return Mistake(id, stage, explanation, hint, fn)

    return wrap


V, P, S, QK = FUNCTION_STAGES

MISTAKES: tuple[Mistake, ...] = (
    _m(
        "value-missing-transpose",
        V,
        "dV was computed as P·dO: P is used without its transpose",
        "O = P·V, so dV = Pᵀ·dO; transpose the last two dims of p (p.transpose(-2, -1))",
    )(lambda p, do: (p @ do,)),
    _m(
        "value-swapped-operands",
        V,
        "dV was computed as dOᵀ·P, the transpose of the right answer",
        "put P first: dV = Pᵀ·dO has the shape of V, [B, Nk, d]",
    )(lambda p, do: (_tr(do) @ p,)),
    _m(
        "probability-missing-transpose",
        P,
        "dP was computed as dO·V: V is used without its transpose",
        "O = P·V, so dP = dO·Vᵀ; transpose the last two dims of v",
    )(lambda do, v: (do @ v,)),
    _m(
        "probability-swapped-operands",
        P,
        "dP was computed as V·dOᵀ, the transpose of the right answer",
        "put dO first: dP = dO·Vᵀ has the shape of P, [B, Nq, Nk]",
    )(lambda do, v: (v @ _tr(do),)),
    _m(
        "softmax-no-rowsum",
        S,
        "dS was computed as P∘dP: the row-sum term is missing",
        "subtract each row's weighted sum: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * dp,)),
    _m(
        "softmax-rowsum-wrong-dim",
        S,
        "the weighted sum was taken over the query dim (dim=-2) instead of the key dim",
        "sum over the last dim: (p * dp).sum(dim=-1, keepdim=True)",
    )(lambda p, dp: (p * (dp - (p * dp).sum(dim=-2, keepdim=True)),)),
    _m(
        "softmax-keepdim-lost",
        S,
        "the row sum lost its last dim, so it broadcast along the wrong axis",
        "keep the summed dim: (p * dp).sum(dim=-1, keepdim=True) has shape [B, N, 1]",
    )(lambda p, dp: (p * (dp - (p * dp).sum(dim=-1)),)),
    _m(
        "softmax-missing-p",
        S,
        "dS was computed as dP − rowsum(P∘dP): the outer factor P is missing",
        "multiply by P at the end: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (dp - _rowsum(p * dp),)),
    _m(
        "softmax-sign",
        S,
        "dS has the wrong sign: P∘(rowsum(P∘dP) − dP)",
        "the row sum is subtracted from dP: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * (_rowsum(p * dp) - dp),)),
    _m(
        "softmax-sign",
        S,
        "the row sum was added instead of subtracted: P∘(dP + rowsum(P∘dP))",
        "the row sum is subtracted from dP: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * (dp + _rowsum(p * dp)),)),
    _m(
        "softmax-unweighted-rowsum",
        S,
        "the row sum is rowsum(dP), not the weighted rowsum(P∘dP)",
        "weight by the probabilities before summing: (p * dp).sum(dim=-1, keepdim=True)",
    )(lambda p, dp: (p * (dp - _rowsum(dp)),)),
    _m(
        "qk-missing-scale",
        QK,
        "dQ and dK miss the scale factor 1/√d",
        "S = s·Q·Kᵀ, so both gradients carry s: dQ = s·dS·K, dK = s·dSᵀ·Q",
    )(lambda ds, q, k, s: (ds @ k, _tr(ds) @ q)),
    _m(
        "qk-missing-scale",
        QK,
        "dK misses the scale factor 1/√d (dQ has it)",
        "both branches carry the same scale: dK = s·dSᵀ·Q",
    )(lambda ds, q, k, s: (s * ds @ k, _tr(ds) @ q)),
    _m(
        "qk-missing-scale",
        QK,
        "dQ misses the scale factor 1/√d (dK has it)",
        "both branches carry the same scale: dQ = s·dS·K",
    )(lambda ds, q, k, s: (ds @ k, s * _tr(ds) @ q)),
    _m(
        "qk-wrong-scale",
        QK,
        "the scale was applied twice (s² = 1/d)",
        "multiply by scale once; it is already 1/√d",
    )(lambda ds, q, k, s: (s * s * ds @ k, s * s * _tr(ds) @ q)),
    _m(
        "qk-wrong-scale",
        QK,
        "the gradients were multiplied by √d instead of 1/√d",
        "scale is 1/√d: multiply by it, do not divide by it",
    )(lambda ds, q, k, s: (ds @ k / s, _tr(ds) @ q / s)),
    _m(
        "key-missing-transpose",
        QK,
        "dK was computed as s·dS·Q: dS is used without its transpose",
        "S = s·Q·Kᵀ, so dK = s·dSᵀ·Q; transpose ds before multiplying by q",
    )(lambda ds, q, k, s: (s * ds @ k, s * ds @ q)),
    _m(
        "query-extra-transpose",
        QK,
        "dQ was computed as s·dSᵀ·K: dS should not be transposed for the query",
        "dQ = s·dS·K uses dS as it is; only dK needs dSᵀ",
    )(lambda ds, q, k, s: (s * _tr(ds) @ k, s * _tr(ds) @ q)),
    _m(
        "qk-swapped",
        QK,
        "dQ and dK are exchanged: the function returned (dK, dQ)",
        "return (dq, dk) in that order: dq = s·dS·K (like q), dk = s·dSᵀ·Q (like k)",
    )(lambda ds, q, k, s: (s * _tr(ds) @ q, s * ds @ k)),
)

FALLBACK_HINTS = {
    "not-implemented": "replace the `raise NotImplementedError` with the formula in the docstring",
    "shape-mismatch": "compare the result's shape with the one in the docstring",
    "non-finite": "the result holds NaN or inf; look for a division or log",
    "wrong-dtype": "compute in the inputs' dtype (float64 here); do not cast",
    "wrong-values": "re-derive the formula step by step and compare with the docstring",
    "crashed": "run the function yourself on small [B, N, d] tensors and read the traceback",
    "timeout": "the function did not return in time; look for a loop that never ends",
}


# ------------------------------------------------------------------------ outcomes


@dataclass
class Outcome:
    """What one call gave: values, or the exception it raised."""

    values: Outputs | None = None
    error: BaseException | None = None


def _call(fn: Fn, args: tuple[Any, ...], n_out: int) -> Outcome:
    args = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)  # in-place safe
    try:
        out = fn(*args)
    except Exception as e:  # the learner's code may raise anything
        return Outcome(error=e)
    values = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(values) != n_out or not all(isinstance(t, Tensor) for t in values):
        kind = type(out).__name__
        want = "a tensor" if n_out == 1 else f"a tuple of {n_out} tensors"
        return Outcome(error=TypeError(f"returned {kind}, expected {want}"))
    return Outcome(values=tuple(t.detach() for t in values))


def _close(a: Outputs, b: Outputs, tol: float) -> bool:
    return all(
        x.shape == y.shape and bool(((x.to(torch.float64) - y).abs() <= tol).all())
        for x, y in zip(a, b, strict=True)
    )


def _tol(bound: float, probe: tuple[int, ...]) -> float:
    """A few float64 eps times the magnitude |A||B| times the longest reduction."""
    return 16.0 * max(probe) * EPS * max(bound, 1.0)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _explains(
    mistake: Mistake, learner: list[Outcome], inputs: list[Any], tols: list[float]
) -> bool:
    witnessed = False
    for out, args, tol in zip(learner, inputs, tols, strict=True):
        want = _call(mistake.fn, args, len(REFERENCE[mistake.stage](*args)))
        if want.values is None:
            if out.values is not None:
                return False
            continue
        if out.values is None:
            return False
        scale = max(float(t.abs().max()) for t in want.values)
        if not _close(out.values, want.values, max(tol, _tol(scale, (1,)) * 4)):
            return False
        witnessed = True
    return witnessed


def grade_function(stage: str, fn: Fn, seed: int = 0) -> dict[str, Any]:
    """Run ``fn`` on every probe against the reference; a dict for the stage's report."""
    gen = torch.Generator().manual_seed(seed + TODO_NUMBER[stage])
    inputs = [_inputs(stage, probe, gen) for probe in PROBES]
    refs = [REFERENCE[stage](*args) for args in inputs]
    tols = [_tol(_bound(stage, a), pr) for a, pr in zip(inputs, PROBES, strict=True)]
    outs = [_call(fn, args, len(ref)) for args, ref in zip(inputs, refs, strict=True)]
    result: dict[str, Any] = {"name": stage, "passed": False, "diagnosis": None}

    def fail(diagnosis: str, message: str, hint: str | None = None) -> dict[str, Any]:
        result.update(diagnosis=diagnosis, message=message, hint=hint or FALLBACK_HINTS[diagnosis])
        return result

    if all(isinstance(o.error, NotImplementedError) for o in outs):
        return fail("not-implemented", f"TODO {TODO_NUMBER[stage]} is not implemented yet")
    good = [
        o.values is not None and _close(o.values, r, t)
        for o, r, t in zip(outs, refs, tols, strict=True)
    ]
    if all(good):
        result.update(message=f"matches the reference on {len(PROBES)} probes", hint="")
        result["passed"] = True
        return result
    for mistake in MISTAKES:
        if mistake.stage == stage and _explains(mistake, outs, inputs, tols):
            return fail(mistake.id, mistake.explanation, mistake.hint)
    shapes = "(B, Nq, Nk, d, dv)"
    for o, probe in zip(outs, PROBES, strict=True):
        if o.values is not None and not all(bool(t.isfinite().all()) for t in o.values):
            return fail("non-finite", f"NaN or inf in the result on probe {shapes}={probe}")
    for o, r, probe in zip(outs, refs, PROBES, strict=True):
        if o.values is not None and [t.shape for t in o.values] != [t.shape for t in r]:
            got = ", ".join(str(tuple(t.shape)) for t in o.values)
            want = ", ".join(str(tuple(t.shape)) for t in r)
            return fail("shape-mismatch", f"shape {got}, expected {want} on {shapes}={probe}")
    for o, probe in zip(outs, PROBES, strict=True):
        if o.error is not None:
            return fail("crashed", f"{_error_text(o.error)} on {shapes}={probe}")
    for o in outs:
        if o.values is not None and any(t.dtype != torch.float64 for t in o.values):
            return fail("wrong-dtype", f"float64 inputs gave a {o.values[0].dtype} result")
    worst = max(
        (float((x - y).abs().max()), probe)
        for o, r, probe in zip(outs, refs, PROBES, strict=True)
        if o.values is not None
        for x, y in zip(o.values, r, strict=True)
    )
    return fail("wrong-values", f"max error {worst[0]:.3g} on {shapes}={worst[1]}")


# -------------------------------------------------------------- CustomAttention stage


def _attention_ref(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.softmax(q @ _tr(k) / math.sqrt(q.size(-1)), dim=-1) @ v


# [B, N, d]: batched, d != N, d = N, B = 1
ATTENTION_PROBES = ((2, 5, 3), (3, 4, 4), (1, 3, 6), (2, 2, 5))
# the chapter's input contract: one bad call for each check its CustomAttention.forward
# makes (3-D inputs; batch and sequence lengths shared; head dims shared; one device; one
# dtype), with the exception the chapter raises there.  Only those: a call outside them
# (integer inputs, say, which torch itself refuses with a RuntimeError) is not graded.
CONTRACT: tuple[tuple[str, Callable[[], tuple[Tensor, ...]], type[Exception]], ...] = (
    (
        "sequence lengths differ",
        lambda: (torch.randn(2, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 3, 4)),
        ValueError,
    ),
    (
        "batch sizes differ",
        lambda: (torch.randn(2, 3, 4), torch.randn(1, 3, 4), torch.randn(2, 3, 4)),
        ValueError,
    ),
    ("a 2-D input", lambda: (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)), ValueError),
    (
        "head dims differ",
        lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 4)),
        ValueError,
    ),
    (
        "value head dim differs",
        lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 5)),
        ValueError,
    ),
    (
        # the meta device stands for a second device on a machine with one
        "devices differ",
        lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 4, device="meta"), torch.randn(2, 3, 4)),
        ValueError,
    ),
    (
        "dtypes differ",
        lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 4).double(), torch.randn(2, 3, 4)),
        TypeError,
    ),
)


def grade_attention(cls: Any, failed_todos: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Forward and backward against autograd through the reference, gradcheck, the contract."""
    result: dict[str, Any] = {"name": "CustomAttention", "passed": False, "diagnosis": None}
    todo = ", ".join(f"TODO {TODO_NUMBER[s]} ({s})" for s in failed_todos)
    after = f"; fix {todo} first" if todo else ""

    def fail(diagnosis: str, message: str, hint: str) -> dict[str, Any]:
        result.update(diagnosis=diagnosis, message=message + after, hint=hint)
        return result

    apply = getattr(cls, "apply", None)
    if apply is None:
        return fail("crashed", "CustomAttention has no .apply", "keep the autograd.Function")
    gen = torch.Generator().manual_seed(seed + 7)
    for b, n, d in ATTENTION_PROBES:
        q, k, v = (
            torch.randn(b, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn(b, n, d, generator=gen, dtype=torch.float64)
        where = f"on [B, N, d]=[{b}, {n}, {d}]"
        ref = _attention_ref(q, k, v)
        grads = torch.autograd.grad(ref, (q, k, v), dout)
        ref = ref.detach()
        tol = 64.0 * (n + d) * EPS * max(1.0, float(ref.abs().max()))
        try:
            out = apply(q, k, v)
        except Exception as e:
            return fail("crashed", f"forward raised {_error_text(e)} {where}", "see the traceback")
        if not isinstance(out, Tensor) or out.shape != ref.shape:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return fail("shape-mismatch", f"forward gave {shape}, expected {tuple(ref.shape)}", "")
        if not bool(out.isfinite().all()):
            return fail("non-finite", f"NaN or inf in the output {where}", "")
        if not bool(((out.detach() - ref.detach()).abs() <= tol).all()):
            return fail(
                "forward-wrong",
                f"output differs from softmax(Q·Kᵀ/√d)·V {where}",
                "the forward is given; restore it",
            )
        try:
            mine = torch.autograd.grad(out, (q, k, v), dout)
        except NotImplementedError as e:
            return fail(
                "not-implemented", f"backward: {_error_text(e)}", FALLBACK_HINTS["not-implemented"]
            )
        except Exception as e:
            return fail("crashed", f"backward raised {_error_text(e)} {where}", "see the traceback")
        gtol = 64.0 * (n + d) * EPS * max(1.0, max(float(g.abs().max()) for g in grads))
        bad = []
        for name, g, want in zip(("dq", "dk", "dv"), mine, grads, strict=True):
            if g is None or g.shape != want.shape:
                bad.append(f"{name} has the wrong shape")
            elif not bool(g.isfinite().all()):
                bad.append(f"{name} is not finite")
            elif not bool(((g - want).abs() <= gtol).all()):
                bad.append(f"{name} is wrong")
        if bad:
            return fail(
                "backward-wrong",
                ", ".join(bad) + f" {where}",
                "backward must return (dq, dk, dv) built from the four functions",
            )
    q, k, v = (
        torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    try:
        ok = torch.autograd.gradcheck(apply, (q, k, v), eps=1e-6, atol=1e-5, raise_exception=False)
    except Exception as e:
        ok, why = False, _error_text(e)
    else:
        why = "numerical and analytical Jacobians differ"
    if not ok:
        return fail("gradcheck-failed", f"gradcheck in float64: {why}", "compare each gradient")
    for what, make, exc in CONTRACT:
        try:
            apply(*make())
        except exc:
            continue
        except Exception as e:
            return fail(
                "contract-violated",
                f"{what}: raised {type(e).__name__}, expected {exc.__name__}",
                "keep the input checks at the top of forward",
            )
        return fail(
            "contract-violated",
            f"{what}: accepted, expected {exc.__name__}",
            "keep the input checks at the top of forward",
        )
    result.update(
        passed=not failed_todos,
        message="forward, backward, gradcheck and the input contract pass" + after,
        hint="",
    )
    if failed_todos:
        result["diagnosis"] = "depends-on-todo"
    return result


# ------------------------------------------------------------------- child process


def _load(path: str) -> Any:
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location("attngrad_learner", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attngrad_learner"] = module
    spec.loader.exec_module(module)
    return module


def child_main(argv: Sequence[str]) -> None:
    """``child_main([path, stage, ...])``: one JSON event per line on the original stdout.

    Events: ``{"event": "imported"}`` or ``{"event": "import-failed", "error": ...}``,
    then ``{"event": "start", "stage": name}`` and the stage's result dict per stage.
    The learner's own prints go to stderr.
    """
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)

    def emit(event: dict[str, Any]) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    path, stages = argv[0], list(argv[1:])
    try:
        module = _load(path)
    except BaseException as e:  # SystemExit and friends at import are the learner's too
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        emit({"event": "import-failed", "error": tb[:300]})
        return
    emit({"event": "imported"})
    failed: list[str] = []
    for stage in stages:
        emit({"event": "start", "stage": stage})
        fn = getattr(module, stage, None)
        if fn is None:
            res: dict[str, Any] = {
                "name": stage,
                "passed": False,
                "diagnosis": "crashed",
                "message": f"the module defines no {stage}",
                "hint": f"keep the name {stage} from the skeleton",
            }
        elif stage == "CustomAttention":
            failed = [s for s in os.environ.get("ATTNGRAD_FAILED", "").split(",") if s] + failed
            res = grade_attention(fn, failed)
        else:
            res = grade_function(stage, fn)
        if not res["passed"] and stage != "CustomAttention":
            failed.append(stage)
        emit({"event": "result", **res})
