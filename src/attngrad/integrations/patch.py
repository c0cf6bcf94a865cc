"""`patch_sdpa`: every ``torch.nn.functional.scaled_dot_product_attention`` call runs attngrad.

For code that calls SDPA itself (a nanoGPT-style module, transformers'
``attn_implementation="sdpa"``) and that you do not want to edit::

    with attngrad.patch_sdpa(strategy="flash"):
        loss = model(x).loss          # each SDPA call is attngrad.attention(..., strategy="flash")
        loss.backward()

Leaving the block restores the function that was there, also when the block
raises; blocks nest.  Backward needs no patch: the autograd graph recorded
inside already holds attngrad's nodes.  The patch replaces the attribute of
``torch.nn.functional``, so it reaches calls that look SDPA up there when
they run (``F.scaled_dot_product_attention(...)``), not a name bound earlier
by ``from torch.nn.functional import scaled_dot_product_attention``.
torch.compile inside the block traces attngrad's ops (`attngrad.call.compiled`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from attngrad.api import attention
from attngrad.core.contract import validate_strategy
from attngrad.strategies import STRATEGIES

__all__ = ["patch_sdpa"]


def patch_sdpa(strategy: str = "auto") -> contextlib.AbstractContextManager[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to `attngrad.attention` inside.

    strategy: one of `attngrad.STRATEGIES` or "auto", used by every patched call
    (checked here, before anything is patched).  Also usable as a decorator
    (``@attngrad.patch_sdpa("flash")``).  The patch is process-wide: other
    threads calling SDPA inside the block run attngrad too.
    """
    validate_strategy(strategy, STRATEGIES)
    return _patched(strategy)


@contextlib.contextmanager
def _patched(strategy: str) -> Iterator[None]:
    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA's signature and shapes: [..., Hq, Nq, d], [..., Hkv, Nk, d], [..., Hkv, Nk, dv]."""
        return attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            strategy=strategy,
        )  # fmt: skip

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
