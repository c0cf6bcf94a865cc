"""Integrations of `attngrad.attention` with other libraries.

* `attngrad.integrations.transformers`: ``register()`` makes attngrad an
  ``attn_implementation`` of Hugging Face transformers
  (``pip install 'attngrad[hf]'``).
* `attngrad.integrations.patch` (``attngrad.patch_sdpa``) and
  `attngrad.integrations.patch_flex` (``attngrad.patch_flex_attention``):
  code that calls torch's SDPA or FlexAttention itself (transformers'
  ``"sdpa"`` and ``"flex_attention"`` among it) runs attngrad inside a block.

Each integration imports its library only when it is used, so
``import attngrad.integrations.<name>`` works without it.
"""

from __future__ import annotations

__all__: list[str] = []
