"""attngrad: scaled-dot-product attention with hand-written backward passes.

The same gradient formulas (see `attngrad.core.ops`) run along several execution
strategies; each is checked against a float64 reference.  Bad arguments raise
`ArgumentError` (a ValueError) or `ArgumentTypeError` (a TypeError), both also
RuntimeErrors, which is what PyTorch's scaled_dot_product_attention raises.

>>> import torch, attngrad
>>> q = torch.randn(1, 4, 32, 16, requires_grad=True)
>>> attngrad.attention(q, q, q, strategy="explicit").sum().backward()
"""

from attngrad.api import attention, flex_attention
from attngrad.core.block_mask import create_block_mask
from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.core.ops import (
    probability_gradient,
    query_key_gradients,
    softmax_backward,
    value_gradient,
)
from attngrad.integrations.patch import patch_sdpa
from attngrad.integrations.patch_flex import patch_flex_attention
from attngrad.learn.chapter import CustomAttention
from attngrad.ring import flex_ring_attention, ring_attention
from attngrad.strategies import STRATEGIES

__all__ = [
    "STRATEGIES",
    "ArgumentError",
    "ArgumentTypeError",
    "CustomAttention",
    "attention",
    "create_block_mask",
    "flex_attention",
    "flex_ring_attention",
    "patch_flex_attention",
    "patch_sdpa",
    "probability_gradient",
    "query_key_gradients",
    "ring_attention",
    "softmax_backward",
    "value_gradient",
]

__version__ = "0.7.0"
