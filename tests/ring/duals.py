"""Forward-mode runs shared by the ring's test files: a call on dual tensors and forward over
reverse (the gradients' tangents), each through forward_ad and through torch.func, returning
the values the tests compare."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import forward_ad

Call = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def forward_mode(
    call: Call, primals: dict[str, torch.Tensor], tangents: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """out, lse and their tangents ("tout", "tlse") of ``call`` on primals + tangents."""
    with forward_ad.dual_level():
        duals = {n: forward_ad.make_dual(p, tangents[n]) for n, p in primals.items()}
        out, lse = call(duals)
        (o, to), (lse_, tlse) = (forward_ad.unpack_dual(x) for x in (out, lse))
    return {"out": o, "lse": lse_, "tout": to, "tlse": tlse}


def func_jvp(
    call: Call, primals: dict[str, torch.Tensor], tangents: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`forward_mode`'s values through ``torch.func.jvp``."""
    names = list(primals)

    def over(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return call(dict(zip(names, xs, strict=True)))

    (out, lse), (t_out, t_lse) = torch.func.jvp(
        over, tuple(primals.values()), tuple(tangents[n] for n in names)
    )
    return {"out": out, "lse": lse, "tout": t_out, "tlse": t_lse}


def forward_over_reverse(
    call: Call,
    leaves: dict[str, torch.Tensor],
    tangents: dict[str, torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """out, the gradients of loss(out, lse) w.r.t. the leaves ("d" + name) and their
    tangents along ``tangents`` ("hvp" + name: Hessian-vector products)."""
    with forward_ad.dual_level():
        duals = {n: forward_ad.make_dual(t, tangents[n]) for n, t in leaves.items()}
        out, lse = call(duals)
        grads = torch.autograd.grad(loss(out, lse), list(duals.values()), create_graph=True)
        unpacked = dict(zip(leaves, (forward_ad.unpack_dual(g) for g in grads), strict=True))
        got = {"out": forward_ad.unpack_dual(out).primal.detach()}
        got |= {"d" + n: u.primal.detach() for n, u in unpacked.items()}
        got |= {"hvp" + n: u.tangent.detach() for n, u in unpacked.items()}
    return got


def func_forward_over_reverse(
    call: Call,
    leaves: dict[str, torch.Tensor],
    tangents: dict[str, torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """`forward_over_reverse`'s values through ``torch.func.jvp`` of ``torch.func.grad``."""
    names = list(leaves)

    def scalar(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = call(dict(zip(names, xs, strict=True)))
        return loss(out, lse), out

    grads = torch.func.grad(scalar, argnums=tuple(range(len(names))), has_aux=True)
    primals = tuple(t.detach() for t in leaves.values())
    (g, out), (t_g, _) = torch.func.jvp(grads, primals, tuple(tangents[n] for n in names))
    got = {"out": out}
    got |= {"d" + n: x for n, x in zip(names, g, strict=True)}
    got |= {"hvp" + n: x for n, x in zip(names, t_g, strict=True)}
    return got
