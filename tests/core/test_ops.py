"""Each local op of `attngrad.core.ops` against PyTorch autograd, in float64.

Every op claims to work on any number of leading batch dims; the layouts
below give the score matrix shapes [5, 6], [2, 5, 6] and [2, 3, 5, 6]
(Nq=5 != Nk=6 so a transposed result cannot pass by accident).

Results are judged by the error rule's floor (`attngrad.verify.rule.rounding_floor`)
taken from the op's own last step on absolute values: a sum of n products
of magnitude A may be off by u * LAMBDA * sqrt(n) * A, element by element.
"""

from __future__ import annotations

import pytest
import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.verify.cases import Case, outputs_and_grads
from attngrad.verify.reference import reference_attention
from attngrad.verify.rule import judge, rounding_floor
from helpers import assert_floor

NQ, NK, D, DV = 5, 6, 4, 3
LEADS = [(), (2,), (2, 3)]
LEAD_IDS = ["S[5,6]", "S[2,5,6]", "S[2,3,5,6]"]
F64 = dict(dtype=torch.float64)

lead_dims = pytest.mark.parametrize("lead", LEADS, ids=LEAD_IDS)


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, **F64).requires_grad_()


def probabilities(*shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, **F64), dim=-1)


def assert_sum(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    n: int,
    magnitude: torch.Tensor,
    sensitivity: torch.Tensor | None = None,
) -> None:
    """got within the rule's floor of want: magnitude = the last step (n terms) on absolute
    values, sensitivity = what a rounding of the exponent's argument does (softmax)."""
    magnitude = magnitude.detach().double()
    sens = torch.zeros_like(magnitude) if sensitivity is None else sensitivity.detach().double()
    floor = rounding_floor(magnitude, sens, torch.float64, n, 1)
    verdict = judge(name, got.detach(), want.detach(), floor)
    assert verdict.passed, str(verdict)


def softmax_floor(s: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, C) of P = exp((S - m) - log l): l sums Nk terms of P; the exponent's argument
    |S - m| + log l is rounded on its way (C: P times it, plus what l collects of it)."""
    s = s.detach()
    shifted = (s - s.amax(-1, keepdim=True)).abs().nan_to_num(nan=0.0, posinf=0.0)
    log_l = torch.logsumexp(s, -1, keepdim=True) - s.amax(-1, keepdim=True)
    arg = shifted + log_l.nan_to_num(nan=0.0)
    return p, p * (arg + (p * arg).sum(-1, keepdim=True))


def softmax_backward_magnitude(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """|dS|'s bound: P o (|dP| + rowsum(P o |dP|))."""
    return p * (dp.abs() + (p * dp.abs()).sum(-1, keepdim=True))


@lead_dims
@pytest.mark.parametrize("scale", [0.5, 0.37], ids=["scale0.5", "scale0.37"])
def test_scores_forward_and_query_key_gradients(lead, scale):
    q, k = leaf(*lead, NQ, D), leaf(*lead, NK, D)
    s = ops.scores(q, k, scale)
    expected = scale * torch.einsum("...id,...jd->...ij", q.detach(), k.detach())
    qa, ka = q.detach().abs(), k.detach().abs()
    assert_sum("S", s, expected, D, scale * qa @ ka.transpose(-2, -1))

    ds = torch.randn_like(s)
    s.backward(ds)
    dq, dk = ops.query_key_gradients(ds, q.detach(), k.detach(), scale)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert_sum("dq", dq, q.grad, NK, scale * ds.abs() @ ka)
    assert_sum("dk", dk, k.grad, NQ, scale * ds.abs().transpose(-2, -1) @ qa)


@lead_dims
def test_softmax_forward_and_backward(lead):
    s = leaf(*lead, NQ, NK)
    p = ops.softmax(s.detach())
    assert_sum("P", p, torch.softmax(s.detach(), dim=-1), NK, *softmax_floor(s, p))

    dp = torch.randn_like(p)
    torch.softmax(s, dim=-1).backward(dp)  # ops.softmax works in place: autograd of torch's
    ds = ops.softmax_backward(p, dp)
    assert_sum("dS", ds, s.grad, NK, softmax_backward_magnitude(p, dp))


@lead_dims
def test_softmax_backward_rows_sum_to_zero(lead):
    # the row-sum term removes the normalisation direction: softmax is invariant to
    # adding a constant to a row, so no gradient may point along (1, ..., 1).
    # dp is shifted far from zero so that a missing subtraction cannot pass.
    p = probabilities(*lead, NQ, NK)
    dp = torch.randn(*lead, NQ, NK, **F64) + 3.0
    ds = ops.softmax_backward(p, dp)
    row = softmax_backward_magnitude(p, dp).sum(-1)  # the row sum adds these magnitudes
    assert_sum("rowsum dS", ds.sum(dim=-1), torch.zeros(*lead, NQ, **F64), NK, row)
    assert ds.abs().sum() > 0


@lead_dims
def test_softmax_dead_rows_give_zero_probabilities(lead):
    s = torch.randn(*lead, NQ, NK, **F64)
    s[..., 2, :] = float("-inf")  # the row attends no key: found from the scores alone
    p = ops.softmax(s)
    assert torch.isfinite(p).all()
    assert (p[..., 2, :] == 0).all()
    alive = [i for i in range(NQ) if i != 2]
    live = s[..., alive, :]
    assert_sum(
        "P", p[..., alive, :], torch.softmax(live, -1), NK, *softmax_floor(live, p[..., alive, :])
    )
    # and the backward through a zero row is zero, not NaN
    ds = ops.softmax_backward(p, torch.randn_like(p))
    assert torch.isfinite(ds).all() and (ds[..., 2, :] == 0).all()


def test_softmax_dead_rows_differ_across_lead_dims():
    # a row is dead in one batch entry and alive in the others: each row is its own
    s = torch.randn(2, 3, NQ, NK, **F64)
    s[0, 1, 0, :] = float("-inf")
    s[1, :, 3, :] = float("-inf")
    dead = (s == float("-inf")).all(-1)
    p = ops.softmax(s)
    assert torch.isfinite(p).all() and (p[dead] == 0).all()
    alive = p[~dead]
    assert_sum("rowsum P", alive.sum(-1), torch.ones(alive.shape[0], **F64), NK, alive.sum(-1))


def test_softmax_with_a_live_minus_inf_entry_is_plain_softmax():
    # a -inf entry (not a whole row) gets P = 0 and leaves the row a plain softmax
    s = torch.randn(NQ, NK, **F64)
    s[0, 0] = float("-inf")
    p = ops.softmax(s)
    assert_sum("P", p, torch.softmax(s, dim=-1), NK, *softmax_floor(s, p))
    assert p[0, 0] == 0


@lead_dims
def test_softmax_statistics_rebuild_p_and_give_the_lse(lead):
    s = torch.randn(*lead, NQ, NK, **F64) * 30
    s[..., 1, :] = float("-inf")  # a dead row: m = 0, log l = +inf, lse = -inf
    s[..., 3, 2] = float("-inf")
    p, stats = ops.softmax_(s.clone())
    assert stats.shape == (*lead, NQ, 2)
    assert (stats[..., 1, 0] == 0).all() and (stats[..., 1, 1] == float("inf")).all()
    assert torch.equal(stats[..., 0].masked_fill(stats[..., 1] == float("inf"), 0), stats[..., 0])
    # m is the row max exactly, and P rebuilt from the statistics is the P of forward
    live = [i for i in range(NQ) if i != 1]
    assert torch.equal(stats[..., live, 0], s[..., live, :].amax(-1))
    rebuilt = ops.probabilities_(s.clone(), stats)
    assert (rebuilt[..., 1, :] == 0).all() and (rebuilt[..., 3, 2] == 0).all()
    assert_sum(
        "P rebuilt", rebuilt, torch.softmax(s, -1).nan_to_num(nan=0.0), NK, *softmax_floor(s, p)
    )
    lse = ops.lse(stats)
    assert (lse[..., 1] == float("-inf")).all()
    want = torch.logsumexp(s[..., live, :], -1)
    assert_sum("lse", lse[..., live], want, NK, want.abs())


@lead_dims
def test_attend_and_its_two_gradients(lead):
    p, v = leaf(*lead, NQ, NK), leaf(*lead, NK, DV)
    o = ops.attend(p, v)
    pa, va = p.detach().abs(), v.detach().abs()
    assert_sum("O", o, p.detach() @ v.detach(), NK, pa @ va)

    dout = torch.randn_like(o)
    o.backward(dout)
    dv = ops.value_gradient(p.detach(), dout)
    dp = ops.probability_gradient(dout, v.detach())
    assert dv.shape == v.shape and dp.shape == p.shape
    assert_sum("dV", dv, v.grad, NQ, pa.transpose(-2, -1) @ dout.abs())
    assert_sum("dP", dp, p.grad, DV, dout.abs() @ va.transpose(-2, -1))


@lead_dims
def test_local_ops_chain_to_autograd_of_whole_attention(lead):
    """The four local backward ops, chained by hand, give autograd's dq, dk, dv."""
    q, k, v = (torch.randn(*lead, n, x, **F64) for n, x in ((NQ, D), (NK, D), (NK, DV)))
    dout = torch.randn(*lead, NQ, DV, **F64)
    scale = D**-0.5
    p = ops.softmax(ops.scores(q, k, scale))
    o = ops.attend(p, v)
    dv = ops.value_gradient(p, dout)
    ds = ops.softmax_backward(p, ops.probability_gradient(dout, v))
    dq, dk = ops.query_key_gradients(ds, q, k, scale)
    got = {"out": o, "dq": dq, "dk": dk, "dv": dv}
    # [*lead, N, x] as a case: the last lead dim plays the heads (one head without lead dims)
    case = Case(Shapes(lead[:-1], *(lead[-1:] or (1,)) * 2, NQ, NK, D, DV))
    inputs = {"q": q, "k": k, "v": v, "mask": None, "dout": dout}
    want = outputs_and_grads(reference_attention, case, inputs, torch.float64)
    assert_floor(case, inputs, got, want)


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
    assert torch.equal(dp, expected)  # the out-of-place variant is this one on a copy
    assert torch.equal(p, p_before) and p._version == p_version, "p must not be touched"


def test_softmax_backward_out_of_place_does_not_bump_versions():
    p = probabilities(NQ, NK)
    dp = torch.randn(NQ, NK, **F64)
    versions = (p._version, dp._version)
    ops.softmax_backward(p, dp)
    assert (p._version, dp._version) == versions
