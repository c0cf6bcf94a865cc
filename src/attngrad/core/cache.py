"""Where attngrad keeps what it builds between runs: one root, a folder per kind."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """$ATTNGRAD_CACHE_DIR, else $XDG_CACHE_HOME/attngrad, else ~/.cache/attngrad."""
    root = os.environ.get("ATTNGRAD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attngrad"
    )
    return Path(root)
