"""Integrations of `attngrad.attention` with other libraries.

* `attngrad.integrations.transformers`: ``register()`` makes attngrad an
  ``attn_implementation`` of Hugging Face transformers
  (``pip install 'attngrad[hf]'``).

Each integration imports its library only when it is used, so
``import attngrad.integrations.<name>`` works without it.
"""

from __future__ import annotations

__all__: list[str] = []
