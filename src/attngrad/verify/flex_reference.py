r"""The dense reference of a FlexAttention call: the whole score matrix, straight from the definition.

`reference_flex_attention` takes ``flex_attention``'s arguments and computes, on
the full [B, Hq, Nq, Nk] score matrix, with plain PyTorch ops that autograd
differentiates to every order (q, k, v and every tensor the score function
captures)::

    X  = scale q k^T                      k, v repeated per query head (enable_gqa)
    T  = score_mod(X, b, h, i, j)          every score at once: torch.vmap over the index
                                           grids b, h, i, j (0-d int32), as torch's eager path
    S  = T, -inf where the BlockMask drops the score:
         an empty block drops all of it, a full block keeps all of it (mask_mod is not
         called), a partial block keeps where mask_mod(b, h, i, j) is True
    P  = softmax(S) (0 on a row that attends nothing)      O = P v

The BlockMask is read from its own lists (``kv_num_blocks``/``kv_indices`` for
the partial blocks, ``full_kv_num_blocks``/``full_kv_indices`` for the full
ones), not from `attngrad.core.block_table`, so the strategies' reading of it
is checked against an independent one.  Run in float64 it is the reference;
`plain_flex_attention` is the same computation in the inputs' dtype, the
plain run of the 2x rule (`attngrad.verify.rule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from attngrad.verify.formula import expand_kv, raw_scores, row_softmax, score_scale

__all__ = [
    "block_keep",
    "grid_scores",
    "over_grid",
    "plain_flex_attention",
    "reference_flex_attention",
    "reference_flex_lse",
]

_INDEX = torch.int32


def over_grid(
    point: Callable[..., torch.Tensor],
    shape: Sequence[int],
    device: torch.device,
    scores: Sequence[torch.Tensor] = (),
    whole: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``point(*scores, b, h, i, j, *whole)`` -- written for 0-d arguments -- on every element of
    the grid ``shape`` = [B, H, Nq, Nk] at once: nested torch.vmap over b, h, i, j (kv_idx
    innermost, as torch's eager flex_attention).

    scores: tensors shaped like the grid, one element per call; whole: tensors passed whole
    to every call (nothing here; the score functions close over theirs).
    """
    fn = point
    lead = len(scores)
    for axis in (3, 2, 1, 0):
        dims = (0,) * lead + tuple(0 if a == axis else None for a in range(4))
        fn = torch.vmap(fn, in_dims=dims + (None,) * len(whole))
    index = [torch.arange(n, dtype=_INDEX, device=device) for n in shape]
    return fn(*scores, *index, *whole)


def grid_scores(score_mod: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """T = score_mod(X, b, h, i, j) on every score of x [B, H, Nq, Nk] (`over_grid`)."""
    return over_grid(score_mod, x.shape, x.device, (x,))


def _listed(num: torch.Tensor, indices: torch.Tensor, blocks_k: int) -> torch.Tensor:
    """bool [Bm, Hm, QB, KB]: key block c is among the first num[..., r] of indices[..., r, :]."""
    slots = torch.arange(indices.shape[-1], device=num.device) < num.unsqueeze(-1)
    hot = F.one_hot(indices.long(), max(blocks_k, int(indices.max()) + 1 if indices.numel() else 1))
    return (hot * slots.unsqueeze(-1)).sum(-2)[..., :blocks_k] > 0


def block_keep(block_mask: object, batch: int, heads: int, seq_q: int, seq_k: int) -> torch.Tensor:
    """bool [B, H, Nq, Nk]: the scores the BlockMask keeps (module docstring).

    A block listed full keeps every score, one listed partial those where its
    mask_mod is True, one listed in neither none.  block_mask: torch's
    ``BlockMask`` for (Nq, Nk), shared (1) or given per batch entry and head.
    """
    bm = block_mask
    bq, bk = (int(n) for n in bm.BLOCK_SIZE)  # type: ignore[attr-defined]
    blocks_k = -(-seq_k // bk)
    partial = _listed(bm.kv_num_blocks, bm.kv_indices, blocks_k)  # type: ignore[attr-defined]
    full = torch.zeros_like(partial)
    if bm.full_kv_num_blocks is not None:  # type: ignore[attr-defined]
        full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, blocks_k)  # type: ignore[attr-defined]

    def per_score(blocks: torch.Tensor) -> torch.Tensor:
        dense = blocks.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        return dense[..., :seq_q, :seq_k].expand(batch, heads, seq_q, seq_k)

    device = bm.kv_num_blocks.device  # type: ignore[attr-defined]
    mask = over_grid(bm.mask_mod, (batch, heads, seq_q, seq_k), device)  # type: ignore[attr-defined]
    return per_score(full) | (per_score(partial) & mask)


def _modified(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None,
    block_mask: object,
    scale: float | None,
    scale_first: bool = False,
) -> torch.Tensor:
    """S [B, Hq, Nq, Nk]: the scaled scores through score_mod, -inf where the BlockMask drops
    them (or score_mod gave -inf); key per query head.  In the query's dtype: a score function
    that reads a wider tensor (float32 parameters beside 16-bit activations) widens the
    scores it returns, and they are rounded back, as torch's eager flex_attention rounds
    its probabilities to the query's dtype."""
    x = raw_scores(query, key, score_scale(query, scale), scale_first)
    t = x if score_mod is None else grid_scores(score_mod, x).to(x.dtype)
    if block_mask is None:
        return t
    keep = block_keep(block_mask, *t.shape).to(t.device)
    return t.masked_fill(~keep, float("-inf"))


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None,
    block_mask: object,
    scale: float | None,
    enable_gqa: bool,
    scale_first: bool = False,
) -> torch.Tensor:
    key, value = expand_kv(query, key, value, enable_gqa)
    s = _modified(query, key, score_mod, block_mask, scale, scale_first)
    return row_softmax(s) @ value


def reference_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None = None,
    block_mask: object = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """softmax(mask(score_mod(scale q k^T))) v on the whole score matrix, in the inputs' dtype.

    query: [B, Hq, Nq, d], key: [B, Hkv, Nk, d], value: [B, Hkv, Nk, dv] ->
    [B, Hq, Nq, dv]; score_mod and block_mask as torch's flex_attention takes
    them (module docstring).  Differentiable in q, k, v and whatever score_mod
    reads, to every order.
    """
    return _attention(query, key, value, score_mod, block_mask, scale, enable_gqa)


def reference_flex_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None = None,
    block_mask: object = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """logsumexp of each row's modified, masked scores: [B, Hq, Nq]; -inf on a row that
    attends nothing."""
    key, _ = expand_kv(query, key, key, enable_gqa)
    return torch.logsumexp(_modified(query, key, score_mod, block_mask, scale), dim=-1)


def plain_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None = None,
    block_mask: object = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The plain PyTorch computation of the 2x rule: `reference_flex_attention` in the inputs'
    dtype (scores, score_mod, softmax and products all in it).  In float64, where that would
    be the reference itself, the scale goes onto q before the product, (s q) k^T: float64 in
    another order."""
    scale_first = query.dtype == torch.float64
    return _attention(query, key, value, score_mod, block_mask, scale, enable_gqa, scale_first)
