"""Each local op of `attngrad.ops` against PyTorch autograd, in float64.

Every op claims to work on any number of leading batch dims; the layouts
below give the score matrix shapes [5, 6], [2, 5, 6] and [2, 3, 5, 6]
(Nq=5 != Nk=6 so a transposed result cannot pass by accident).
"""

from __future__ import annotations

import pytest
import torch

from attngrad import ops

NQ, NK, D, DV = 5, 6, 4, 3
LEADS = [(), (2,), (2, 3)]
LEAD_IDS = ["S[5,6]", "S[2,5,6]", "S[2,3,5,6]"]
F64 = dict(dtype=torch.float64)
TOL = dict(atol=1e-12, rtol=1e-12)

lead_dims = pytest.mark.parametrize("lead", LEADS, ids=LEAD_IDS)


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, **F64).requires_grad_()


def probabilities(*shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, **F64), dim=-1)


@lead_dims
@pytest.mark.parametrize("scale", [0.5, 0.37], ids=["scale0.5", "scale0.37"])
def test_scores_forward_and_query_key_gradients(lead, scale):
    q, k = leaf(*lead, NQ, D), leaf(*lead, NK, D)
    s = ops.scores(q, k, scale)
    expected = scale * torch.einsum("...id,...jd->...ij", q.detach(), k.detach())
    torch.testing.assert_close(s.detach(), expected, **TOL)

    ds = torch.randn_like(s)
    s.backward(ds)
    dq, dk = ops.query_key_gradients(ds, q.detach(), k.detach(), scale)
    assert dq.shape == q.shape and dk.shape == k.shape
    torch.testing.assert_close(dq, q.grad, **TOL)
    torch.testing.assert_close(dk, k.grad, **TOL)


@lead_dims
def test_softmax_forward_and_backward(lead):
    s = leaf(*lead, NQ, NK)
    p = ops.softmax(s)
    torch.testing.assert_close(p.detach(), torch.softmax(s.detach(), dim=-1), **TOL)

    dp = torch.randn_like(p)
    p.backward(dp)
    ds = ops.softmax_backward(p.detach(), dp)
    torch.testing.assert_close(ds, s.grad, **TOL)


@lead_dims
def test_softmax_backward_rows_sum_to_zero(lead):
    # the row-sum term removes the normalisation direction: softmax is invariant to
    # adding a constant to a row, so no gradient may point along (1, ..., 1).
    # dp is shifted far from zero so that a missing subtraction cannot pass.
    p = probabilities(*lead, NQ, NK)
    dp = torch.randn(*lead, NQ, NK, **F64) + 3.0
    ds = ops.softmax_backward(p, dp)
    torch.testing.assert_close(ds.sum(dim=-1), torch.zeros(*lead, NQ, **F64), atol=1e-12, rtol=0)
    assert ds.abs().sum() > 0


@lead_dims
def test_softmax_dead_rows_give_zero_probabilities(lead):
    s = torch.randn(*lead, NQ, NK, **F64)
    dead = torch.zeros(*lead, NQ, dtype=torch.bool)
    dead[..., 2] = True
    s[..., 2, :] = float("-inf")  # the row attends no key
    p = ops.softmax(s, dead)
    assert torch.isfinite(p).all()
    assert (p[..., 2, :] == 0).all()
    alive = [i for i in range(NQ) if i != 2]
    torch.testing.assert_close(p[..., alive, :], torch.softmax(s[..., alive, :], dim=-1), **TOL)
    # and the backward through a zero row is zero, not NaN
    ds = ops.softmax_backward(p, torch.randn_like(p))
    assert torch.isfinite(ds).all() and (ds[..., 2, :] == 0).all()


def test_softmax_dead_rows_broadcast_over_lead_dims():
    # dead_rows is documented as broadcastable against the rows: one [Nq] mask
    # shared by every batch entry
    s = torch.randn(2, 3, NQ, NK, **F64)
    s[..., 0, :] = float("-inf")
    dead = torch.tensor([True] + [False] * (NQ - 1))
    p = ops.softmax(s, dead)
    assert (p[..., 0, :] == 0).all() and torch.isfinite(p).all()
    torch.testing.assert_close(p[..., 1:, :].sum(-1), torch.ones(2, 3, NQ - 1, **F64), **TOL)


def test_softmax_without_dead_rows_argument_is_plain_softmax():
    # dead_rows=None with a live -inf entry (not a whole row) must stay a plain softmax
    s = torch.randn(NQ, NK, **F64)
    s[0, 0] = float("-inf")
    p = ops.softmax(s, torch.zeros(NQ, dtype=torch.bool))
    torch.testing.assert_close(p, torch.softmax(s, dim=-1), **TOL)
    assert p[0, 0] == 0


@lead_dims
def test_attend_and_its_two_gradients(lead):
    p, v = leaf(*lead, NQ, NK), leaf(*lead, NK, DV)
    o = ops.attend(p, v)
    torch.testing.assert_close(o.detach(), p.detach() @ v.detach(), **TOL)

    dout = torch.randn_like(o)
    o.backward(dout)
    dv = ops.value_gradient(p.detach(), dout)
    dp = ops.probability_gradient(dout, v.detach())
    assert dv.shape == v.shape and dp.shape == p.shape
    torch.testing.assert_close(dv, v.grad, **TOL)
    torch.testing.assert_close(dp, p.grad, **TOL)


@lead_dims
def test_local_ops_chain_to_autograd_of_whole_attention(lead):
    """The four local backward ops, chained by hand, give autograd's dq, dk, dv."""
    q, k, v = leaf(*lead, NQ, D), leaf(*lead, NK, D), leaf(*lead, NK, DV)
    scale = D**-0.5
    o = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    dout = torch.randn_like(o)
    o.backward(dout)

    p = ops.softmax(ops.scores(q.detach(), k.detach(), scale))
    dv = ops.value_gradient(p, dout)
    ds = ops.softmax_backward(p, ops.probability_gradient(dout, v.detach()))
    dq, dk = ops.query_key_gradients(ds, q.detach(), k.detach(), scale)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, **TOL)


@lead_dims
def test_softmax_backward_in_place_overwrites_only_dp(lead):
    p = probabilities(*lead, NQ, NK)
    dp = torch.randn(*lead, NQ, NK, **F64)
    p_before, dp_before = p.clone(), dp.clone()
    p_version = p._version

    expected = ops.softmax_backward(p, dp)
    # the out-of-place variant left both arguments alone
    assert torch.equal(dp, dp_before) and torch.equal(p, p_before)

    dp_version = dp._version
    result = ops.softmax_backward_(p, dp)
    assert result.data_ptr() == dp.data_ptr(), "must return its dp buffer"
    assert dp._version > dp_version, "dp was not written in place"
    torch.testing.assert_close(dp, expected, **TOL)
    assert torch.equal(p, p_before) and p._version == p_version, "p must not be touched"


def test_softmax_backward_out_of_place_does_not_bump_versions():
    p = probabilities(NQ, NK)
    dp = torch.randn(NQ, NK, **F64)
    versions = (p._version, dp._version)
    ops.softmax_backward(p, dp)
    assert (p._version, dp._version) == versions
