"""The reference every strategy is judged against must itself be right:
float64 agreement with SDPA's MATH backend, and a genuine same-dtype
computation when run in low precision (or the 2x rule would be vacuous).

Both are judged by the rule's floor alone (`helpers.assert_floor`): the 2x
term would compare SDPA MATH with itself, which is the plain float64 run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attngrad.verify import bounds
from attngrad.verify.bounds import magnitudes
from attngrad.verify.cases import (
    as_attention,
    dropout_mask,
    make_inputs,
    outputs_and_grads,
    received,
)
from attngrad.verify.reference import plain_attention, reference_attention, reference_lse
from attngrad.verify.rule import case_floors, judge
from helpers import assert_floor, case, dtype_name, sdpa_math

CASES = [
    case((), 3, 3, 6, 9, 8, 8),  # the course chapter's [B, N, d] layout
    case((2,), 4, 4, 5, 7, 8, 6, "causal"),
    case((2,), 4, 4, 9, 4, 8, 6, "causal"),  # Nq > Nk, top-left aligned
    case((2,), 4, 4, 5, 7, 8, 6, "float", (7,)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (2, 1, 5, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 4, 1, 7)),
    case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7), scale=0.3),
    case((2,), 6, 2, 5, 7, 8, 6, "bool", (5, 7)),
    case((2, 3), 4, 1, 4, 9, 8, 5, "float", (3, 1, 4, 9)),
]


def _has_rows(c) -> bool:
    return c.mask in ("bool", "float") and len(c.mask_shape) >= 2 and c.mask_shape[-2] > 1


REFERENCE_PARAMS = [pytest.param(c, False, id=c.id) for c in CASES] + [
    # a query row that attends nothing: SDPA MATH gives zeros there, so must the reference
    pytest.param(c, True, id=c.id + "-dead-row")
    for c in CASES
    if _has_rows(c)
]


@pytest.mark.parametrize(("c", "dead_row"), REFERENCE_PARAMS)
def test_reference_matches_sdpa_math_float64(c, dead_row):
    inputs = make_inputs(c, dead_row=dead_row)
    if dead_row and c.mask == "float":  # make_inputs kills a row of bool masks only
        inputs["mask"][..., 1, :] = float("-inf")  # type: ignore[index]
    got = outputs_and_grads(reference_attention, c, inputs, torch.float64)
    want = outputs_and_grads(sdpa_math, c, inputs, torch.float64)
    assert_floor(c, inputs, got, want)
    if dead_row:
        assert (got["out"][..., 1, :] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_name)
def test_reference_computes_in_the_input_dtype(dtype):
    # the 2x rule compares against "plain PyTorch in the same dtype": a reference
    # that silently upcast would have ~zero error and fail every honest kernel
    c = case((2,), 4, 2, 33, 47, 59, 24, "float", (4, 33, 47), dtype=dtype)
    inputs = received(
        make_inputs(c), dtype
    )  # what the dtype can hold, so only the computation errs
    exact = outputs_and_grads(reference_attention, c, inputs, torch.float64)
    low = outputs_and_grads(reference_attention, c, inputs, dtype)
    for name, t in low.items():
        assert t.dtype == dtype, name
        assert not torch.equal(t.double(), exact[name]), f"{name} has no rounding error"
    if dtype == torch.float32:  # its error is the rounding of a correct computation
        assert_floor(c, inputs, low, exact)
        return
    # scores, P and dS rounded to 16 bits on the way: several times the error of the same
    # computation run in float32 and rounded once at the end, which an upcast would give
    once = outputs_and_grads(reference_attention, c, inputs, torch.float32)
    for name in ("dq", "dk"):
        err_low, err_once = (
            (t.to(dtype).double() - exact[name]).abs().max() for t in (low[name], once[name])
        )
        assert err_low > 2 * err_once, (name, float(err_low), float(err_once))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_name)
def test_plain_attention_is_the_reference_below_float64_and_sdpa_math_in_it(dtype):
    c = case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7), dtype=dtype)
    inputs = make_inputs(c)
    plain = outputs_and_grads(plain_attention, c, inputs, dtype)
    other = sdpa_math if dtype == torch.float64 else reference_attention
    want = outputs_and_grads(other, c, inputs, dtype)
    assert all(torch.equal(plain[n], want[n]) for n in want)


def test_reference_window_is_the_band_as_a_bool_mask():
    c = case((1,), 2, 2, 9, 12, 4, 4, "bool", (9, 12))
    inputs = make_inputs(c, dead_row=False)
    i, j = torch.arange(9)[:, None], torch.arange(12)[None, :]
    band = (j >= i - 2) & (j <= i + 1)
    windowed = dataclasses.replace(c, window=(2, 1))
    got = outputs_and_grads(reference_attention, windowed, inputs, torch.float64)
    inputs["mask"] = inputs["mask"] & band  # type: ignore[operator]
    want = outputs_and_grads(reference_attention, c, inputs, torch.float64)
    assert all(torch.equal(got[n], want[n]) for n in want)


# --- attention's options beyond SDPA, each checked by hand --------------------------------

F64 = torch.float64


def _qkv(lead, hq, nq, nk, d=4, hkv=None):
    """Random float64 q [*lead, Hq, Nq, d], k, v [*lead, Hkv, Nk, d]."""
    hkv = hq if hkv is None else hkv
    q = torch.randn(*lead, hq, nq, d, dtype=F64)
    k = torch.randn(*lead, hkv, nk, d, dtype=F64)
    return q, k, torch.randn(*lead, hkv, nk, d, dtype=F64)


def _grads(fn, *inputs):
    """fn's output and its gradients in every input, for a fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _picture(rows: str) -> torch.Tensor:
    """A keep mask drawn as rows of x (attend) and . (masked), separated by spaces."""
    return torch.tensor([[c == "x" for c in row] for row in rows.split()])


def test_softcap_is_c_tanh_of_the_scores_before_the_mask():
    q, k, v = _qkv((2,), 2, 3, 5)
    bias = torch.randn(3, 5, dtype=F64)
    c = 0.7
    s = q @ k.transpose(-2, -1) / 2  # scale 1/sqrt(4)
    want = torch.softmax(c * torch.tanh(s / c) + bias, dim=-1) @ v
    torch.testing.assert_close(reference_attention(q, k, v, bias, softcap=c), want)
    # a large cap changes nothing; the cap bounds every score: |c tanh| < c
    far = reference_attention(q, k, v, bias, softcap=1e6)
    torch.testing.assert_close(far, reference_attention(q, k, v, bias))
    lse = reference_lse(q, k, bias, softcap=c)
    torch.testing.assert_close(lse, torch.logsumexp(c * torch.tanh(s / c) + bias, dim=-1))


@pytest.mark.parametrize("per", ["head", "token"])
def test_sinks_are_a_zero_value_key_whose_score_is_the_sink(per):
    q, k, v = _qkv((2,), 3, 4, 6)
    sinks = torch.randn(3 if per == "head" else (2, 3, 4), dtype=F64)
    bias = torch.randn(2, 3, 4, 6, dtype=F64)
    sigma = (sinks[:, None] if per == "head" else sinks).expand(2, 3, 4)

    def with_key(q, k, v, bias, sinks):
        # the sink as key Nk: zero key, zero value, its score sigma through the bias
        sig = (sinks[:, None] if per == "head" else sinks).expand(2, 3, 4)
        k1 = torch.cat([k, torch.zeros(2, 3, 1, 4, dtype=F64)], dim=-2)
        v1 = torch.cat([v, torch.zeros(2, 3, 1, 4, dtype=F64)], dim=-2)
        return reference_attention(q, k1, v1, torch.cat([bias, sig[..., None]], dim=-1))

    def with_sinks(q, k, v, bias, sinks):
        return reference_attention(q, k, v, bias, sinks=sinks)

    got, want = (_grads(f, q, k, v, bias, sinks) for f in (with_sinks, with_key))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    lse = reference_lse(q, k, bias, sinks=sinks)
    torch.testing.assert_close(lse, torch.logaddexp(reference_lse(q, k, bias), sigma))


def test_a_row_without_keys_gives_the_sink_everything_and_a_zero_output():
    q, k, v = _qkv((1,), 2, 3, 4)
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1] = False
    sinks = torch.randn(2, dtype=F64, requires_grad=True)
    out = reference_attention(q, k, v, keep, sinks=sinks)
    assert (out[..., 1, :] == 0).all() and out.isfinite().all()
    (dsinks,) = torch.autograd.grad(out.sum(), sinks)
    assert dsinks.isfinite().all()
    # the dead row's lse is its sink; without a sink (or with one at -inf) it is -inf
    assert torch.equal(reference_lse(q, k, keep, sinks=sinks)[..., 1], sinks.detach()[None])
    dead = reference_attention(q, k, v, keep, sinks=torch.full((2,), float("-inf"), dtype=F64))
    assert (dead[..., 1, :] == 0).all() and dead.isfinite().all()


@pytest.mark.parametrize(
    ("nq", "nk", "window", "picture"),
    [
        # causal, Nq < Nk: the last query sees every key
        (2, 4, None, "xxx. xxxx"),
        # causal, Nq > Nk: query i sits at key i - 2, the first two see nothing
        (4, 2, None, ".. .. x. xx"),
        # window (1, 1) without causal, Nq < Nk: query i at key i + 3, the last one past the end
        (2, 5, (1, 1), "..xxx ...xx"),
        # window (2, 0): causal and two keys back, query i at key i + 3
        (3, 6, (2, 0), ".xxx.. ..xxx. ...xxx"),
    ],
)
def test_bottom_right_alignment_matches_the_pictures(nq, nk, window, picture):
    q, k, v = _qkv((2,), 2, nq, nk)
    keep = _picture(picture)
    is_causal = window is None
    got = _grads(
        lambda q, k, v: reference_attention(
            q, k, v, is_causal=is_causal, window=window, align="bottom-right"
        ),
        q, k, v,
    )  # fmt: skip
    want = _grads(lambda q, k, v: reference_attention(q, k, v, keep), q, k, v)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # top-left is SDPA's is_causal
    if is_causal:
        torch.testing.assert_close(
            reference_attention(q, k, v, is_causal=True), sdpa_math(q, k, v, is_causal=True)
        )


def test_packed_segments_are_one_call_per_segment_pair():
    # band.py's picture: queries 0-2 attend keys 0-1, queries 3-4 keys 2-5, causal bottom-right;
    # a third pair has queries and no keys (an empty key segment): zero rows
    cu_q, cu_k = torch.tensor([0, 3, 5, 7]), torch.tensor([0, 2, 6, 6])
    q, k, v = _qkv((2,), 2, 7, 6, hkv=1)
    mask = torch.randn(2, 7, 6, dtype=F64)

    def packed(q, k, v, mask):
        return reference_attention(
            q, k, v, mask, is_causal=True, enable_gqa=True, align="bottom-right",
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        )  # fmt: skip

    def looped(q, k, v, mask):
        parts = []
        for (q0, q1), (k0, k1) in zip(cu_q.unfold(0, 2, 1), cu_k.unfold(0, 2, 1), strict=True):
            if k0 == k1:
                parts.append(torch.zeros(2, 2, q1 - q0, 4, dtype=F64))
                continue
            parts.append(
                reference_attention(
                    q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                    mask[..., q0:q1, k0:k1], is_causal=True, enable_gqa=True,
                    align="bottom-right",
                )
            )  # fmt: skip
        return torch.cat(parts, dim=-2)

    got, want = (_grads(f, q, k, v, mask) for f in (packed, looped))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)  # products of other shapes
    # segment 0 row 0 sits before its first key, as in band.py's picture
    out = got[0]
    assert (out[..., 0, :] == 0).all() and (out[..., 5:, :] == 0).all()
    assert (out[..., 1:5, :] != 0).all()


def test_packed_self_attention_defaults_the_key_segments_to_the_query_ones():
    q, k, v = _qkv((1,), 2, 5, 5)
    cu = torch.tensor([0, 2, 5])
    one = reference_attention(q, k, v, is_causal=True, cu_seqlens_q=cu)
    both = reference_attention(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert torch.equal(one, both)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        reference_attention(q, k, v, cu_seqlens_k=cu)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_scales_the_kept_probabilities_of_the_given_mask(p):
    q, k, v = _qkv((2,), 2, 4, 6)
    z = torch.rand(2, 2, 4, 6) > 0.4
    probs = torch.softmax(q @ k.transpose(-2, -1) / 2, dim=-1)
    kept = 0.0 if p == 1 else 1 / (1 - p)
    want = (probs * z * kept) @ v
    got = reference_attention(q, k, v, dropout_mask=z, dropout_p=p)
    torch.testing.assert_close(got, want)
    if p == 1:
        assert (got == 0).all()
    # lse is of the scores: dropout, after the softmax, does not enter it
    torch.testing.assert_close(
        reference_lse(q, k), torch.logsumexp(q @ k.transpose(-2, -1) / 2, -1)
    )


def test_dropout_without_a_mask_is_refused():
    q, k, v = _qkv((1,), 1, 2, 3)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference_attention(q, k, v, dropout_p=0.1)


# --- plain_attention and magnitudes with the options -------------------------------------

FEATURE_CASES = [
    case((2,), 2, 2, 6, 9, 8, 8, "float", softcap=0.8),
    case((2,), 2, 1, 6, 9, 8, 8, "bool", (6, 9), sinks="head"),
    case((2,), 2, 2, 6, 9, 8, 8, "float", (2, 6, 9), sinks="token"),
    case((2,), 2, 2, 9, 4, 8, 8, "causal", align="bottom-right"),
    case((1,), 2, 2, 6, 9, 5, 5, window=(2, 1), align="bottom-right"),
    case((1,), 2, 2, 7, 6, 8, 8, "causal", segments=((3, 2, 2), (2, 4, 0))),
    case((2,), 2, 2, 6, 9, 8, 8, "float", dropout=0.3),
]


@pytest.mark.parametrize("c", FEATURE_CASES, ids=lambda c: c.id)
def test_plain_float64_agrees_with_the_reference_in_another_order(c):
    # SDPA MATH where it can say the call (band as a mask, sinks as a key), else the
    # reference's formula with the scale applied to q first: float64 rounding apart
    inputs = make_inputs(c)
    got = outputs_and_grads(as_attention(plain_attention), c, inputs, F64)
    want = outputs_and_grads(as_attention(reference_attention), c, inputs, F64)
    assert set(got) == set(want)
    floors = case_floors(c, inputs, want)  # float64 inputs: received as they are
    failed = [str(v) for n in want if not (v := judge(n, got[n], want[n], floors[n])).passed]
    assert not failed, failed


@pytest.mark.parametrize("c", FEATURE_CASES, ids=lambda c: c.id)
def test_magnitudes_bound_every_result_of_the_reference(c):
    # A_x is the last step on absolute values: |x| <= A_x for every element, and a C_x for each
    inputs = make_inputs(c)
    want = outputs_and_grads(as_attention(reference_attention), c, inputs, F64)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    kwargs = {n: x for n, x in c.kwargs.items() if n != "generator"}
    if c.dropout:
        kwargs["dropout_mask"] = dropout_mask(q, k, c.dropout, c.kwargs["generator"])
    mags, sens, readback, kept, lse = magnitudes(
        q, k, v, dout, inputs["mask"], sinks=inputs["sinks"], **kwargs
    )
    assert set(mags) == set(sens) == set(readback) == set(kept) == set(want)
    for name, x in want.items():
        assert (x.abs() <= mags[name] * (1 + 1e-12)).all(), name
        for bound in (sens[name], readback[name], kept[name]):
            assert (bound >= 0).all() and bound.shape == x.shape, name
    assert (lse >= 0).all() and lse.shape == want["out"].shape[:-1]


def _moves_by_brute_force(p, p_sink, a):
    """max |P_j' - P_j| over every choice of each score's move, +-a_i (the extremes), float64."""
    n = p.shape[-1]
    signs = torch.tensor([[1.0 if (m >> i) & 1 else -1.0 for i in range(n)] for m in range(2**n)])
    weights = p * torch.exp(signs * a)  # [patterns, n]
    moved = weights / (weights.sum(-1, keepdim=True) + p_sink)
    return (moved - p).abs().amax(0)


ROWS = [
    # (P of the keys, the sink's share (the row sums to 1), each score's largest move u C_S)
    ([0.5, 0.3, 0.2], 0.0, [0.1, 0.2, 0.05]),
    ([1.0, 0.0, 0.0], 0.0, [3.0, 5.0, 1.0]),  # one-hot: no move at all
    ([1e-30, 1.0 - 1e-30], 0.0, [0.5, 60.0]),  # a tail P beside a key that moves by 60
    ([1e-30, 0.6, 0.4 - 1e-30], 0.0, [0.5, 60.0, 55.0]),
    ([0.25, 0.25], 0.5, [1.0, 2.0]),  # a sink takes half the row
    ([1e-20, 0.7], 0.3 - 1e-20, [40.0, 45.0]),
    ([0.9, 0.1 - 1e-5 - 1e-12, 1e-12, 1e-5], 0.0, [1e-9, 2e-9, 30.0, 7.0]),
]


@pytest.mark.parametrize(("p", "p_sink", "a"), ROWS)
def test_the_probability_move_is_the_largest_any_score_moves_allow(p, p_sink, a):
    # C_P of the rule's floor (bounds._probability_move) against every choice of the
    # scores' moves, each P and the row's sum moving together: it bounds them, and is reached
    p, a = torch.tensor(p, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)
    u = 1e-3
    got = bounds._probability_move(p, torch.tensor(p_sink, dtype=torch.float64), a / u, u) * u
    want = _moves_by_brute_force(p, p_sink, a)
    assert torch.all(got >= want * (1 - 1e-9)), (got, want)
    assert torch.allclose(got, want, rtol=1e-9, atol=0.0), (got, want)
    if (p > 0).sum() == 1 and p_sink == 0:
        assert (got == 0).all()


def test_a_score_that_may_move_without_bound_may_take_all_of_the_others():
    # a bias at finfo.min beside live keys: its move is infinite; every other P may fall to 0
    p = torch.tensor([1e-30, 0.5, 0.5 - 1e-30], dtype=torch.float64)
    a = torch.tensor([math.inf, 1.0, 1.0], dtype=torch.float64)
    got = bounds._probability_move(p, torch.tensor(0.0, dtype=torch.float64), a, 1.0)
    assert torch.equal(got[1:], p[1:])
    assert not got.isnan().any()
