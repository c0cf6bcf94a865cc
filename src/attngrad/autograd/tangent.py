r"""Forward mode: the tangent of O and lse, tile by tile, O(N) extra memory.

With tangents q', k', v', bias' of the inputs, the scores move by
S' = L(q', k', bias') = scale * (q' k^T + q k'^T) + bias'
(`attngrad.autograd.linearized`) and, per query row::

    P'   = P * (S' - mu),      mu = rowsum(P * S') = lse'
    O'   = P' v + P v' = (P * S') v + P v' - mu O

With dropout (O = (P * M) v, M = Z / (1 - p)) the products with v take
P * M and (P * S') * M, while mu keeps the undropped P; S' is pushed through
the score modifications (a softcap's slope, a score function's push with the
tangents of its captured tensors; `attngrad.autograd.linearized`).

In the online-softmax form of the forward (`attngrad.strategies.flash`),
over key tiles j with running max m_j, alpha_j = exp(m_{j-1} - m_j) and
E_j = exp(S_j - m_j)::

    l_j   = alpha_j l_{j-1}   + rowsum(E_j)
    acc_j = alpha_j acc_{j-1} + E_j v_j
    t_j   = alpha_j t_{j-1}   + rowsum(E_j * S'_j)              (-> mu l)
    acc'_j = alpha_j acc'_{j-1} + (E_j * S'_j) v_j + E_j v'_j   (-> (O' + mu O) l)

    O = acc / l,   mu = t / l,   O' = acc' / l - mu O

two more running accumulators, a row of d_v and one float per query row.
Autograd runs the primal forward before the tangent, so its row statistics
are already final when the tangent pass runs: m is the true row max,
every alpha is 1 and E_j / l is P_j, rebuilt by the strategy's
``probabilities``.  The pass is then the recurrence above with the
rescaling gone: one walk over each block of query rows' key tiles,
accumulating mu and acc' (O(Nq * dv) memory), then O' = acc' - mu O.

Where the tangents are known before the call, a strategy may run that recurrence
itself, rescaling included, in one pass with the forward
(`attngrad.core.interface.Strategy.forward_tangent`: fused's, through
`attngrad.strategies.base.ForwardTangentFunction`); this module serves the rest.

`output_tangent` hands the call to the strategy's own pass where it has one
(`attngrad.core.interface.Strategy.tangent`: fused's C++ kernels), else runs
`tiled_tangent`, that recurrence on the strategy's tiles of P in tensor ops.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from attngrad.autograd import batching
from attngrad.autograd.layout import Layout, roles
from attngrad.autograd.linearized import Terminal, tile_inputs
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Plan, Problem, Saved, Strategy
from attngrad.core.probabilities import rebuilt_records
from attngrad.core.tiling import schedule

__all__ = ["TANGENT", "TANGENT_OUT", "OutputTangent", "output_tangent", "tiled_tangent"]


def output_tangent(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    tangents: tuple[torch.Tensor | None, ...],
    o: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O': [B, Hq, Nq, dv] in the input dtype, lse': [B, Hq, Nq] in the compute dtype):
    the strategy's own pass (`Strategy.tangent`) where it has one, else `tiled_tangent`.

    tangents = (q', k', v', bias', *captured'): like q, k, v, the bias and the score
    function's captured tensors, None for zero.
    o: the forward's O; saved: the strategy's saved tensors.
    """
    own = strategy.tangent(problem, saved, tangents, o)
    return tiled_tangent(strategy, problem, saved, tangents, o) if own is None else own


def tiled_tangent(
    strategy: Strategy[Any],
    problem: Problem[Any],
    saved: Saved,
    tangents: tuple[torch.Tensor | None, ...],
    o: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`output_tangent` on the strategy's tiles of P (``probabilities``) in tensor ops, for
    every strategy and every score modification (module docstring)."""
    t_q, t_k, t_v, t_bias, *t_captured = tangents
    q, k, v, mods, scale = problem.q, problem.k, problem.v, problem.mods, problem.scale
    b, hq, nq, _ = q.shape
    hkv, dv_dim = k.shape[1], v.shape[-1]
    g = hq // hkv
    dtype = problem.dtype
    direction, p_tile, multipliers = tile_inputs(
        strategy, problem, saved, (t_q, t_k, t_bias, *t_captured)
    )
    q5, o5 = group_heads(q, hkv), group_heads(o, hkv)
    k, v = k.to(dtype), v.to(dtype)
    tv = None if t_v is None else t_v.to(dtype)
    out = torch.zeros(b, hkv, g, nq, dv_dim, dtype=dtype, device=q.device)
    mu = torch.zeros(b, hkv, g, nq, 1, dtype=dtype, device=q.device)
    for rows, key_tiles in schedule(mods, strategy.pass_blocks(problem)):
        n = rows.stop - rows.start
        q_r = take_rows(q5, rows).to(dtype)
        acc = torch.zeros(b, hkv, g * n, dv_dim, dtype=dtype, device=q.device)
        mu_r = torch.zeros(b, hkv, g * n, 1, dtype=dtype, device=q.device)
        for keys in key_tiles:
            p = p_tile(rows, keys)
            m = None if multipliers is None else multipliers(rows, keys)  # Z / (1 - p)
            if not direction.zero:
                records = rebuilt_records(mods, q_r, k[:, :, keys], scale, rows, keys)
                ps = direction.tangents(q_r, k, rows, keys, records)[-1].mul_(p)  # P * S'
                mu_r += ps.sum(dim=-1, keepdim=True)
                acc += torch.matmul(ps if m is None else ps.mul_(m), v[:, :, keys])
            if tv is not None:
                acc += torch.matmul(p if m is None else p * m, tv[:, :, keys])
        acc -= mu_r * take_rows(o5, rows).to(dtype)
        out[:, :, :, rows] = acc.view(b, hkv, g, n, dv_dim)
        mu[:, :, :, rows] = mu_r.view(b, hkv, g, n, 1)
    return out.view(b, hq, nq, dv_dim).to(q.dtype), mu.view(b, hq, nq)


# the order `attngrad.strategies.base.AttentionFunction.jvp` passes them in
TANGENT = Layout(
    ("a_q", "a_k", "a_v", "a_bias", "a_captured", "q", "k", "v", "o", "bias", "keep", "saved",
     "captured")
)  # fmt: skip
TANGENT_OUT = Layout(("o", "lse"))


class OutputTangent(Terminal):
    """`output_tangent` as a Function, so that forward mode composes with vmap (jacfwd).

    OutputTangent.apply(*TANGENT, plan) -> (O', lse'): the direction (a_q, a_k, a_v,
    a_bias, *a_captured) is the inputs' tangents (`attngrad.autograd.layout`).
    """

    GRADIENTS_OF_CAPTURED = False
    MISSING = (
        "reverse mode over attngrad's forward mode is not implemented: for second "
        "derivatives take forward over reverse (torch.func.hessian, jacfwd(jacrev(f))) "
        "or reverse over reverse (create_graph=True)."
    )

    @staticmethod
    def roles(plan: Plan[Any]) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """(masks: a_bias, bias, keep; a_captured and captured; no mask outputs)."""
        return roles(TANGENT, TANGENT_OUT, plan)

    @staticmethod
    def forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        *tensors, plan = args
        x = TANGENT.split(plan, tuple(tensors))
        assert x.o is not None
        saved = replace(x, o=None).saved_map(plan)  # O is an output, passed on its own
        return output_tangent(plan.strategy, x.problem(plan), saved, x.direction, x.o)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return batching.vmap_rule(OutputTangent, info, in_dims, args)
