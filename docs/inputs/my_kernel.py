"""A kernel with SDPA's signature that aligns ``is_causal`` bottom-right, FlashAttention 2's
convention, where SDPA's is top-left: ``attngrad verify my_kernel.py:attention`` fails the
causal cases with Nq != Nk, and only those (Verify)."""

import torch
import torch.nn.functional as F


def attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if is_causal:  # the last query row sees every key, not the first Nq of them
        nq, nk = query.shape[-2], key.shape[-2]
        attn_mask = torch.ones(nq, nk, dtype=torch.bool, device=query.device).tril(nk - nq)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, False, scale=scale, enable_gqa=enable_gqa
    )
