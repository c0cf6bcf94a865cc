"""A guard for backward passes that are not themselves differentiable (yet).

``torch.autograd.function.once_differentiable`` raises only when the incoming
gradient requires grad; with ``create_graph=True`` and a constant upstream
gradient it silently hands back gradients detached from the graph, so a
gradient penalty on them would quietly be dropped.  `first_order_only`
refuses every double-backward instead: create_graph turns grad mode on
inside backward, and that is what it checks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["first_order_only", "refuse_double_backward"]

F = TypeVar("F", bound=Callable[..., object])


def refuse_double_backward(name: str) -> None:
    """NotImplementedError when called from a backward that create_graph runs with grad on."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"strategy {name!r} has no double backward yet: its gradients cannot be "
            "differentiated again (create_graph=True, e.g. a gradient penalty). Use "
            "torch.nn.functional.scaled_dot_product_attention's MATH backend for that."
        )


def first_order_only(name: str) -> Callable[[F], F]:
    """Decorate a ``backward``: `refuse_double_backward`, then run it."""

    def decorate(backward: F) -> F:
        @functools.wraps(backward)
        def wrapper(*args: object, **kwargs: object) -> object:
            refuse_double_backward(name)
            return backward(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
