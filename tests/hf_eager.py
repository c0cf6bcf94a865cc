"""A float64-faithful eager attention for Hugging Face transformers, the tests' reference.

`eager64_attention` is transformers' eager attention (Gemma 2's order: softcap, then the
mask) with the softmax in q's dtype, so a model run in float64 is compared with float64
attention, not with transformers' float32 softmax; `always_mask` is sdpa's mask builder told
always to build the bool mask [B, 1, Nq, Nk] it reads.  `register(name)` makes the pair an
``attn_implementation``.  Imported only by the tests that use transformers.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["always_mask", "eager64_attention", "register"]


def eager64_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, Hq, N, d], key/value [B, Hkv, N, d] -> ([B, N, Hq, d], P [B, Hq, N, N])."""
    assert dropout == 0.0
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    assert attention_mask is not None, "always_mask always builds the mask"
    s = s.masked_fill(~attention_mask, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that attends nothing: 0, as SDPA
    return (p @ value).transpose(1, 2).contiguous(), p


def always_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """sdpa's mask builder, told always to build the mask (a bool [B, 1, Nq, Nk])."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)  # type: ignore[arg-type]


def register(name: str) -> None:
    """``attn_implementation=name`` runs `eager64_attention` over `always_mask`'s mask."""
    AttentionInterface.register(name, eager64_attention)
    AttentionMaskInterface.register(name, always_mask)
