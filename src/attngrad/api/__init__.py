"""The public calls: `attention` (SDPA's signature, `attngrad.api.sdpa`) and
`flex_attention` (FlexAttention's, `attngrad.api.flex`)."""

from attngrad.api.flex import flex_attention
from attngrad.api.sdpa import attention

__all__ = ["attention", "flex_attention"]
