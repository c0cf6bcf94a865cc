r"""The higher derivatives of a float64 case, against the reference's.

Beside the error rule (`attngrad.verify.rule`), each float64 case
compares two more derivatives with autograd through the float64 composite
`attngrad.verify.reference.reference_attention`:

* ``second_order_error``: double backward.  With w = the case's dout and
  fixed random directions u (`directions`), g = grad(<O, w>, x,
  create_graph=True) for x = (q, k, v[, mask][, sinks][, theta], w), then
  H = grad(sum_i <g_i, u_i>, x): a Hessian-vector product in q, k, v, the
  mask, the sinks and a flex case's theta, and J u in w (`second_order`).
* ``jvp_error``: forward mode, ``torch.func.jvp`` of the output along the
  tangents u of q, k, v, a float mask, sinks and theta (`output_tangent`).

Each is one number, the max abs error over every element of every result
relative to the reference's largest magnitude, floored at 1
(`relative_error`): max_i max|H_i - H_i_ref| / max(1, max_i max|H_i_ref|).
The floor makes it an absolute error where every result is small (one key:
P = 1, the Hessian is exactly zero and a correct path leaves rounding).
Both must be at most ``DERIVATIVE_TOLERANCE`` = 1e-9 (the issue's "agree at
1e-9 in float64").  In float64 (u = 2^-53 = 1.1e-16) that is about 10^7 u:
every result here is a few chained sums of n <= 10^3 products of O(1)
numbers, each within 6 sqrt(n) u ~ 2e-14 of its magnitudes by the rule's
probabilistic bound, and the grid's errors come out below 1e-14 on every strategy.  The
margin of 10^5 over that covers magnitudes that cancel in the result; a
wrong or missing term is wrong by O(1) of the result and fails by 10^8.
NaN or a crash fails.

torch's own finite-difference checks run here too, in fast mode (a random
projection of the Jacobian): `gradcheck_passes` and `gradgradcheck_passes`
(which differentiates dout as well).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch.autograd.gradcheck import GradcheckError

from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    call_case,
    call_with,
    input_tensor,
    make_leaves,
)
from attngrad.verify.rule import abs_error, largest, reference_fn

__all__ = [
    "DERIVATIVES",
    "DERIVATIVE_TOLERANCE",
    "derivative_errors",
    "directions",
    "gradcheck_passes",
    "gradgradcheck_passes",
    "leaf_elements",
    "output_tangent",
    "relative_error",
    "second_order",
]

# the higher derivatives of a float64 case (module docstring): double backward, forward mode
DERIVATIVES = ("second_order", "jvp")
DERIVATIVE_TOLERANCE = 1e-9


def directions(inputs: Inputs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed random float64 directions u, one like each of q, k, v, a float mask and sinks.

    Drawn from ``seed``.

    They are the cotangents of the first-order gradients in `second_order` and the
    tangents in `output_tangent`; standard normal, drawn apart from `make_inputs`'.
    """
    gen = torch.Generator().manual_seed(seed + 0x5EC0D)
    return {
        n: torch.randn(t.shape, generator=gen, dtype=torch.float64)
        for n, t in make_leaves(inputs).items()
    }


def second_order(
    fn: AttentionFn, case: Case, inputs: Inputs, u: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Double backward of ``fn`` in float64: H = grad(sum_i <g_i, u_i>, x), detached.

    x = (q, k, v[, mask][, sinks][, theta], dout) as float64 leaves, g = grad(<O, dout>, x minus
    dout, create_graph=True), u: `directions` (q, k, v[, mask][, sinks][, theta] shapes).  Keys "q",
    "k", "v", ("mask"), ("sinks") and "dout": H's part for each (the Hessian-vector
    product H_dout u in q, k, v, mask, sinks; J u in dout), shaped like it.  A part autograd leaves
    unconnected is zero.
    """
    x = make_leaves(inputs)
    dout = input_tensor(inputs, "dout").detach().double().clone().requires_grad_()
    out = call_case(fn, case, inputs, x)
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

    ``torch.func.jvp`` at (q, k, v[, mask][, sinks][, theta]) from ``inputs`` with tangents u
    (`directions`); a bool mask is held fixed.
    """
    x = make_leaves(inputs)
    names = list(x)
    primals = tuple(x[n].detach() for n in names)
    call = call_with(fn, case, inputs, names)
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
    error = max(
        (largest(abs_error(got[n].double(), r.double())) for n, r in ref.items()), default=0.0
    )
    magnitude = max((largest(r.double().abs()) for r in ref.values()), default=0.0)
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
        ref = run(reference_fn(case))
        try:
            errors[name] = relative_error(run(fn), ref)
        except Exception as exc:  # a derivative that cannot run fails the case, with its message
            errors[name] = math.inf
            messages.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not errors[name] <= DERIVATIVE_TOLERANCE:
            messages.append(f"{name}: relative error {errors[name]:.3g} > {DERIVATIVE_TOLERANCE:g}")
    return errors, messages


def gradcheck_passes(fn: AttentionFn, case: Case, inputs: Inputs) -> bool:
    """``torch.autograd.gradcheck`` (fast mode) of ``fn`` at the case's float64 inputs.

    Each call gets the case's keywords afresh, so a dropout case's generator
    is re-made there and every call draws the same mask.
    """
    x = make_leaves(inputs)
    call = call_with(fn, case, inputs, list(x))
    try:
        return bool(torch.autograd.gradcheck(call, tuple(x.values()), fast_mode=True))
    except GradcheckError:
        return False


def gradgradcheck_passes(fn: AttentionFn, case: Case, inputs: Inputs) -> bool:
    """``torch.autograd.gradgradcheck`` (fast mode) of ``fn`` at the case's float64 inputs."""
    x = make_leaves(inputs)
    call = call_with(fn, case, inputs, list(x))
    dout = input_tensor(inputs, "dout").detach().double().clone().requires_grad_()
    try:
        return bool(torch.autograd.gradgradcheck(call, tuple(x.values()), (dout,), fast_mode=True))
    except GradcheckError:
        return False


def leaf_elements(inputs: Inputs) -> int:
    """Elements of q, k, v, dout and a float mask: the size gradgradcheck perturbs."""
    return (
        sum(t.numel() for t in make_leaves(inputs).values()) + input_tensor(inputs, "dout").numel()
    )
