"""Double backward is refused loudly, never answered with detached gradients."""

from __future__ import annotations

import pytest
import torch

import attngrad


@pytest.mark.parametrize("strategy", attngrad.STRATEGIES)
def test_create_graph_raises_even_with_a_constant_upstream_gradient(strategy):
    # a gradient penalty: the upstream gradient w is constant, so
    # once_differentiable alone would return detached gradients silently
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    w = torch.randn_like(out)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad((out * w).sum(), q, create_graph=True)


@pytest.mark.parametrize("strategy", attngrad.STRATEGIES)
def test_first_order_backward_still_runs_twice_with_retain_graph(strategy):
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
