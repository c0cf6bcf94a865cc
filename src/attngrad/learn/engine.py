r"""The grader's engine: each stage run on its probes, judged, and a failure diagnosed.

`grade_function` grades one TODO function against the stage's right answers
(`attngrad.learn.stages`) and names the known mistake (`attngrad.learn.mistakes`)
its numbers match; `grade_attention` grades ``CustomAttention`` end to end:
forward and backward against autograd, gradcheck and the chapter's input
contract.  The learner's source is never read.

This module runs inside the child process that `attngrad.learn.grade` starts,
so it imports nothing but the standard library, torch and the child's other
modules (`attngrad.learn.grade.CHILD_MODULES`; importing the ``attngrad``
package costs seconds): the parent loads them by file path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attngrad.learn.mistakes import FALLBACK_HINTS, MISTAKES, Mistake
from attngrad.learn.stages import (
    ANSWERS,
    EPS,
    PROBES,
    TODO_NUMBER,
    Fn,
    Outputs,
    answer_scale,
    stage_inputs,
    tolerance,
    transposed,
)

__all__ = ["ATTENTION_PROBES", "CONTRACT", "grade_attention", "grade_function"]

Tensor = torch.Tensor


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


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _explains(
    mistake: Mistake, learner: list[Outcome], inputs: list[Any], tols: list[float]
) -> bool:
    witnessed = False
    for out, args, tol in zip(learner, inputs, tols, strict=True):
        want = _call(mistake.fn, args, len(ANSWERS[mistake.stage](*args)))
        if want.values is None:
            if out.values is not None:
                return False
            continue
        if out.values is None:
            return False
        scale = max(float(t.abs().max()) for t in want.values)
        if not _close(out.values, want.values, max(tol, tolerance(scale, (1,)) * 4)):
            return False
        witnessed = True
    return witnessed


def grade_function(stage: str, fn: Fn, seed: int = 0) -> dict[str, Any]:
    """Run ``fn`` on every probe against the reference; a dict for the stage's report."""
    gen = torch.Generator().manual_seed(seed + TODO_NUMBER[stage])
    inputs = [stage_inputs(stage, probe, gen) for probe in PROBES]
    refs = [ANSWERS[stage](*args) for args in inputs]
    tols = [tolerance(answer_scale(stage, a), pr) for a, pr in zip(inputs, PROBES, strict=True)]
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


def _attention_ref(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.softmax(q @ transposed(k) / math.sqrt(q.size(-1)), dim=-1) @ v


# [B, N, d]: batched, d != N, d = N, B = 1
ATTENTION_PROBES = ((2, 5, 3), (3, 4, 4), (1, 3, 6), (2, 2, 5))


def _call_of(
    q: tuple[int, ...] = (2, 3, 4),
    k: tuple[int, ...] = (2, 3, 4),
    v: tuple[int, ...] = (2, 3, 4),
    **key: Any,
) -> Callable[[], tuple[Tensor, ...]]:
    """A call on random q, k, v of these shapes [B, N, d] (``key``: k's device or dtype)."""
    return lambda: (torch.randn(*q), torch.randn(*k, **key), torch.randn(*v))


# the chapter's input contract: one bad call for each check its CustomAttention.forward
# makes (3-D inputs; batch and sequence lengths shared; head dims shared; one device; one
# dtype), with the exception the chapter raises there.  Only those: a call outside them
# (integer inputs, say, which torch itself refuses with a RuntimeError) is not graded.
CONTRACT: tuple[tuple[str, Callable[[], tuple[Tensor, ...]], type[Exception]], ...] = (
    ("sequence lengths differ", _call_of(k=(2, 2, 4)), ValueError),
    ("batch sizes differ", _call_of(k=(1, 3, 4)), ValueError),
    ("a 2-D input", _call_of((3, 4), (3, 4), (3, 4)), ValueError),
    ("head dims differ", _call_of(k=(2, 3, 5)), ValueError),
    ("value head dim differs", _call_of(v=(2, 3, 5)), ValueError),
    # the meta device stands for a second device on a machine with one
    ("devices differ", _call_of(device="meta"), ValueError),
    ("dtypes differ", _call_of(dtype=torch.float64), TypeError),
)


def _raised(fn: Fn, args: tuple[Tensor, ...]) -> Exception | None:
    """What ``fn(*args)`` raised, None when it returned."""
    try:
        fn(*args)
    except Exception as e:  # the learner's code may raise anything
        return e
    return None


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
        raised = _raised(apply, make())
        if not isinstance(raised, exc):
            got = "accepted" if raised is None else f"raised {type(raised).__name__}"
            return fail(
                "contract-violated",
                f"{what}: {got}, expected {exc.__name__}",
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
