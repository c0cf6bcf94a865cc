"""The slow, obviously right attention every strategy is judged against.

Plain PyTorch ops differentiated by autograd: k and v are repeated per query
head, the mask is applied to a full score matrix, and rows that attend no key
get P = 0.  Run in float64 it is the reference; run in a low-precision dtype
it is the "plain PyTorch computation in the same dtype" of the 2x error rule.
"""

from __future__ import annotations

import math

import torch

__all__ = ["reference_attention"]


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v, in the inputs' dtype.

    query: [..., Hq, Nq, d], key: [..., Hkv, Nk, d], value: [..., Hkv, Nk, dv],
    attn_mask broadcastable to [..., Hq, Nq, Nk] -> [..., Hq, Nq, dv].
    """
    nq, nk = query.shape[-2], key.shape[-2]
    if enable_gqa:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    s = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=query.device)
    if is_causal:
        keep = keep.tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    s = s.masked_fill(~keep, float("-inf"))
    dead = (s == float("-inf")).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return p @ value
