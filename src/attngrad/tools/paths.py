"""The paths the tools run: each PyTorch baseline named once, and how to run any path.

A path is an attngrad strategy (a name for ``attention(strategy=...)``) or one of
the PyTorch baselines the commands compare with, spelled the same everywhere::

    pytorch-math   softmax(q @ k^T * scale) @ v in plain torch ops
    sdpa-math      F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.MATH)
    sdpa-flash     F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION)

`path_fn` turns a path into q, k, v -> O; `hessian_vector_product` takes the second
derivative along one, as the ledger and ``bench --order 2`` both do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.api import attention

__all__ = [
    "BASELINES",
    "PYTORCH_MATH",
    "SDPA_BASELINES",
    "SDPA_FLASH",
    "SDPA_MATH",
    "Baseline",
    "baseline_name",
    "hessian_vector_product",
    "path_fn",
]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

PYTORCH_MATH = "pytorch-math"
SDPA_MATH = "sdpa-math"
SDPA_FLASH = "sdpa-flash"


@dataclass(frozen=True)
class Baseline:
    """A PyTorch computation of attention that a command compares the strategies with:
    plain torch ops (``backend`` None) or SDPA under one ``backend``."""

    name: str
    about: str
    backend: SDPBackend | None = None


BASELINES: dict[str, Baseline] = {
    b.name: b
    for b in (
        Baseline(PYTORCH_MATH, "softmax(q @ k^T * scale) @ v written with plain torch ops"),
        Baseline(
            SDPA_MATH,
            "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.MATH)",
            SDPBackend.MATH,
        ),
        Baseline(
            SDPA_FLASH,
            "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION)",
            SDPBackend.FLASH_ATTENTION,
        ),
    )
}
# the baselines that are one of SDPA's own backends: what bench and the ledger time
SDPA_BASELINES = tuple(name for name, b in BASELINES.items() if b.backend is not None)


def baseline_name(text: str) -> str:
    """The registered spelling of an SDPA baseline: ``"sdpa-math"`` as is, and the
    backend alone (``"math"``, as ``bench --baseline`` has always taken it) prefixed."""
    name = text if text in BASELINES else f"sdpa-{text}"
    if name not in SDPA_BASELINES:
        raise ValueError(
            f"baseline must be one of {SDPA_BASELINES} (or the backend alone: math, flash), "
            f"got {text!r}; try {SDPA_BASELINES[0]}"
        )
    return name


def _pytorch_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool
) -> torch.Tensor:
    """softmax(q @ k^T * scale) @ v in plain torch ops; causal: top-left aligned, as SDPA.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv] -> O: [B, Hq, Nq, dv].
    """
    if gqa and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)  # (B, Hq, Nk, d)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale  # (B, H, Nq, Nk)
    if causal:
        nq, nk = s.shape[-2:]
        # True above the diagonal: key j > query i is masked
        blocked = torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(blocked, float("-inf"))
    return torch.softmax(s, dim=-1) @ v  # (B, H, Nq, dv)


def path_fn(path: str, causal: bool, gqa: bool = False) -> Attention:
    """q, k, v -> O along one path: a strategy or a baseline (a key of `BASELINES`)."""
    if path not in BASELINES:
        return lambda q, k, v: attention(q, k, v, is_causal=causal, enable_gqa=gqa, strategy=path)
    backend = BASELINES[path].backend
    if backend is None:
        return lambda q, k, v: _pytorch_math(q, k, v, causal, gqa)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return sdpa


def hessian_vector_product(
    grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], w: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """grad(sum_i <g_i, w_i>, inputs) for g built with create_graph=True: H w, one per input."""
    inner = sum((g * wi).sum() for g, wi in zip(grads, w, strict=True))
    return torch.autograd.grad(inner, list(inputs))  # type: ignore[arg-type]
