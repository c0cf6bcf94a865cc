"""Autocast: attngrad takes SDPA's place in torch.autocast's casting rules.

Under ``torch.autocast(device_type, dtype)``, SDPA is one of the ops that run
in the lower precision: every floating-point argument that is not float64 is
cast to the autocast dtype first (so q and k left in float32 by RoPE meet a
bfloat16 v), and the output has that dtype.  `autocast_inputs` applies the
same rule to `attngrad.attention`'s tensors.  Inside, the strategies choose
their own precisions (float32 statistics and accumulators for 16-bit inputs),
so their forward and backward run with autocast off (`outside_autocast`):
left on, it would recast their float32 products to 16 bits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.nn.attention.bias import CausalBias

__all__ = ["autocast_inputs", "no_autocast", "outside_autocast"]

F = TypeVar("F", bound=Callable[..., Any])


def autocast_inputs(*tensors: Any) -> tuple[Any, ...]:
    """``tensors`` as autocast would hand them to SDPA on their device; unchanged outside it.

    Floating-point tensors other than float64 go to the autocast dtype; others
    (bool masks, float64, None, non-tensors) pass through.  Casts are
    differentiable copies: the caller's tensors are never modified.
    """
    device_type = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: Any) -> Any:
        eligible = (
            isinstance(t, torch.Tensor)
            and not isinstance(t, CausalBias)  # a mask object: no values to cast
            and t.is_floating_point()
            and t.dtype != torch.float64
        )
        return t.to(dtype) if eligible else t

    return tuple(cast(t) for t in tensors)


@contextlib.contextmanager
def outside_autocast(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` inside the block (a no-op when it is off already)."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def no_autocast(fn: F) -> F:
    """Run ``fn`` (an autograd.Function's backward or jvp) with autocast off on its tensors' device."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with outside_autocast(device):
            return fn(*args)

    return run  # type: ignore[return-value]
