"""`flex_attention`: a drop-in for `torch.nn.attention.flex_attention.flex_attention`."""

from __future__ import annotations

from typing import Any

import torch

from attngrad.call.flex import FlexCall
from attngrad.core.amp import autocast_inputs, outside_autocast
from attngrad.strategies import REGISTRY
from attngrad.strategies.base import differentiable

__all__ = ["flex_attention"]


@torch.compiler.disable  # type: ignore[untyped-decorator]  # a Python score function cannot enter a compiled graph's ops
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: Any = None,
    strategy: str = "auto",
) -> Any:
    r"""FlexAttention with a hand-written backward: every derivative, on every machine.

    Same arguments, semantics and return types as torch's
    ``torch.nn.attention.flex_attention.flex_attention``::

        query: [B, Hq, Nq, d]     key: [B, Hkv, Nk, d]     value: [B, Hkv, Nk, dv]
        returns: [B, Hq, Nq, dv]  (with return_lse: (out, lse [B, Hq, Nq]);
                 with return_aux=AuxRequest(...): (out, AuxOutput(lse, max_scores)))

    * ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes each scaled
      score S = scale * q k^T (b, h, q_idx, kv_idx are 0-d int32 tensors, h the
      query head).  It may read tensors it captures (a learnable ALiBi slope,
      a relative-position table, a bias computed earlier in the model): their
      gradients are returned in their own dtypes, summed tile by tile in a
      fixed order (bitwise the same for any thread count).
    * ``block_mask``: torch's ``BlockMask`` (``create_block_mask``,
      ``and_masks``, ``or_masks``): empty blocks are skipped, full blocks kept
      without calling its ``mask_mod``, partial blocks call it.  A row that
      attends nothing gets a zero output, zero gradients and lse = -inf.
    * ``enable_gqa``: Hq a multiple of Hkv; query head h reads key/value head
      h // (Hq / Hkv).  ``scale`` defaults to 1/sqrt(d).
    * ``kernel_options`` is accepted and ignored (it tunes torch's Triton
      kernels; attngrad picks its own tiles).
    * ``strategy``: "explicit", "recompute" and "flash" run every score_mod and
      BlockMask.  "fused" runs every BlockMask, and every score_mod made of the ops
      of its programs (`attngrad.core.score_program`): a mask that keeps one
      interval of keys per row, the same for every (b, h) (causal, sliding
      windows, documents, prefix-LM), becomes its kernels' band, with tiles
      outside it skipped; any other runs its mask_mod inside the kernels on the
      partial blocks (a dense bool mask [B, Hq, Nq, Nk] only where the mask_mod
      does not compile).  A relative score_mod reaches the kernels as its term
      along the diagonals, a softcap as their own softcap, any other as a
      program.  "triton" runs neither; a strategy that cannot run a call raises
      ValueError saying why, and
      "auto" takes the fastest that can (`attngrad.strategies.resolve_for`).

    Every derivative works on every strategy that runs the call: backward,
    double backward (``create_graph=True``), forward mode
    (``torch.func.jvp``, ``torch.autograd.forward_ad``), ``torch.func``'s
    ``grad``, ``vjp``, ``vmap``, ``jacrev``, ``jacfwd``, ``hessian`` -- for q,
    k, v and every captured tensor -- at O(N) memory on the tiled strategies.

    Under ``torch.compile`` the call runs eagerly: the graph breaks around it
    (a Python score function cannot enter the compiled graph's ops).

    >>> q = torch.randn(1, 2, 16, 8)
    >>> slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    >>> out = flex_attention(q, q, q, lambda s, b, h, i, j: s + slopes[h] * (j - i))
    >>> out.sum().backward(); slopes.grad.shape
    torch.Size([2])
    """
    query, key, value = autocast_inputs(query, key, value)
    call = FlexCall.build(
        query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
        kernel_options, return_aux, strategy,
    )  # fmt: skip
    with outside_autocast(query.device.type):
        o, lse, stats = differentiable(REGISTRY[call.strategy], call.problem)
    return call.outputs(o, lse, stats)
