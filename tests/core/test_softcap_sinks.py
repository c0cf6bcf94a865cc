"""Soft-capping (Gemma 2) and attention sinks (gpt-oss) on every tensor-op strategy.

Each is checked against what it means in plain float64 math: softcap as
c * tanh(S / c) before the bias, a sink as one more key whose value is zero,
with every gradient (q, k, v, the bias and the sinks) from autograd.
"""

from __future__ import annotations

import math

import pytest
import torch

import attngrad
from helpers import TENSOR_STRATEGIES

ATOL = 1e-12  # float64: every result here is O(1), sums of <= 20 terms


def _inputs(nq: int = 7, nk: int = 9) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = ((2, 4, nq, 5), (2, 2, nk, 5), (2, 2, nk, 3))
    return [torch.randn(*s, dtype=torch.float64).mul_(3).requires_grad_() for s in shapes]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=ATOL)


def _all_grads(out: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(2)
    return [
        out,
        *torch.autograd.grad(
            out, xs, torch.randn_like(out), retain_graph=True, materialize_grads=True
        ),
    ]


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv.repeat_interleave(groups, dim=1)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_softcap_is_c_tanh_of_the_scores_before_the_bias(strategy: str) -> None:
    q, k, v = _inputs()
    bias = torch.randn(4, 7, 9, dtype=torch.float64, requires_grad=True)
    c, scale = 2.5, 1 / math.sqrt(5)
    got = attngrad.attention(q, k, v, bias, enable_gqa=True, softcap=c, strategy=strategy)
    s = c * torch.tanh(q @ _expand(k, 2).transpose(-2, -1) * scale / c) + bias
    want = torch.softmax(s, -1) @ _expand(v, 2)
    xs = [q, k, v, bias]
    _close(_all_grads(got, xs), _all_grads(want, xs))


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("per_token", [False, True])
def test_a_sink_is_a_key_whose_value_is_zero(strategy: str, per_token: bool) -> None:
    q, k, v = _inputs()
    shape = (4, 7) if per_token else (4,)
    sinks = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(2, 1, 7, 9) > 0.3
    keep[:, :, 3] = False  # a row that attends no key
    got, lse = attngrad.attention(
        q, k, v, keep, enable_gqa=True, sinks=sinks, strategy=strategy, return_lse=True
    )
    assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3]))
    # the sink as an extra key column with a value row of zeros
    sink_col = (sinks if per_token else sinks[:, None]).expand(2, 4, 7).unsqueeze(-1)
    s = (q @ _expand(k, 2).transpose(-2, -1) / math.sqrt(5)).masked_fill(~keep, -math.inf)
    p = torch.softmax(torch.cat((s, sink_col), -1), -1)[..., :-1]
    want = p @ _expand(v, 2)
    want_lse = torch.logsumexp(torch.cat((s, sink_col), -1), -1)
    xs = [q, k, v, sinks]
    _close(_all_grads(got, xs), _all_grads(want, xs))
    _close(_all_grads(lse, xs), _all_grads(want_lse, xs))


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_sinks_and_softcap_under_double_backward_and_jvp(strategy: str) -> None:
    q, k, v = (x.detach()[:, :2, :4].clone().requires_grad_() for x in _inputs())
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(q, k, v, sinks=s, softcap=3.0, is_causal=True, strategy=strategy)

    assert torch.autograd.gradcheck(call, (q, k, v, sinks), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(call, (q, k, v, sinks))


def test_bad_softcap_and_sinks_are_refused() -> None:
    q = torch.randn(1, 2, 3, 4)
    cases = [
        ({"softcap": -1.0}, ValueError, "softcap must be finite and > 0"),
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": float("inf")}, ValueError, "softcap"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": True}, TypeError, "softcap"),
        ({"softcap": "50"}, TypeError, "softcap"),
        ({"sinks": torch.zeros(3)}, ValueError, r"sinks has shape \(3,\)"),
        ({"sinks": torch.zeros(2, 4)}, ValueError, "broadcastable"),
        ({"sinks": torch.zeros(())}, ValueError, "sinks has shape"),
        ({"sinks": torch.zeros(2, dtype=torch.float64)}, TypeError, "sinks has dtype"),
        ({"sinks": torch.zeros(2, dtype=torch.int64)}, TypeError, "sinks has dtype"),
        ({"sinks": [0.0, 0.0]}, TypeError, "sinks must be"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            attngrad.attention(q, q, q, **kwargs)
