"""`attngrad.attention` on every strategy: gradcheck, agreement with SDPA's MATH
backend, the 2x error rule in low precision, dead rows, partial requires_grad,
dtypes, what the explicit strategy saves, dropout and causal alignment.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attngrad
from attngrad.reference import reference_attention
from attngrad.verify import Case, run_case, two_x_bound
from helpers import (
    TENSOR_STRATEGIES,
    Problem,
    assert_close_f64,
    dtype_name,
    make_problem_inputs,
    max_abs_err,
    run_problem,
    sdpa_math,
    shape_id,
    strategy_fn,
)

STRATEGIES = attngrad.STRATEGIES
LOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = (torch.float64, *LOW_DTYPES)

by_strategy = pytest.mark.parametrize("strategy", STRATEGIES)
by_tensor_strategy = pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)


# ---------------------------------------------------------------------------
# gradcheck in float64 over mask kinds x GQA x Nq != Nk x odd sizes

GRADCHECK_SIZES = [
    # (Nq, Nk, d, fast_mode).  Full gradcheck perturbs every input element one at
    # a time and builds the Jacobian row by row: fine for d=8 and N<=7, minutes
    # for N=97 or d=59, where fast_mode checks a random projection instead.
    (7, 7, 8, False),
    (1, 7, 8, False),  # a single query row
    (7, 1, 8, False),  # a single key: every live row puts all its weight on it
    (7, 1, 59, True),
    (7, 97, 8, True),
    (97, 7, 59, True),  # Nq > Nk: with is_causal, rows 7.. attend every key
    (97, 97, 59, True),
]
GRADCHECK_HEADS = [(2, 2), (4, 2)]  # GQA off, GQA on (two query heads per k/v head)


def _gradcheck_params():
    for (nq, nk, d, fast), (hq, hkv), mask in itertools.product(
        GRADCHECK_SIZES, GRADCHECK_HEADS, ("none", "causal", "bool", "float")
    ):
        case_id = shape_id((2,), hq, hkv, nq, nk, d, d, mask) + ("-fast" if fast else "")
        marks = [pytest.mark.slow] if max(nq, nk) == 97 else []
        yield pytest.param(hq, hkv, nq, nk, d, mask, fast, id=case_id, marks=marks)


@by_tensor_strategy
@pytest.mark.parametrize(("hq", "hkv", "nq", "nk", "d", "mask", "fast"), list(_gradcheck_params()))
def test_gradcheck(strategy, hq, hkv, nq, nk, d, mask, fast):
    b = 2
    q = torch.randn(b, hq, nq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v]
    fixed_mask = None
    if mask == "bool":
        # shared across heads; row 1 attends nothing (its gradient must be 0, not NaN)
        fixed_mask = torch.rand(b, 1, nq, nk) > 0.3
        fixed_mask[:, :, min(1, nq - 1)] = False
    elif mask == "float":
        # one bias per query head: under GQA its gradient must not be summed per group
        inputs.append(torch.randn(hq, nq, nk, dtype=torch.float64, requires_grad=True))

    def call(q, k, v, *bias):
        m = bias[0] if bias else fixed_mask
        return attngrad.attention(
            q, k, v, m, is_causal=mask == "causal", enable_gqa=hq != hkv, strategy=strategy
        )

    assert torch.autograd.gradcheck(call, tuple(inputs), fast_mode=fast)


# ---------------------------------------------------------------------------
# agreement with SDPA MATH in float64, to 1e-9, for out and every gradient

SDPA_CASES = [
    # the course chapter's [B, N, d] layout: no lead dims, the first dim plays the heads
    Problem((), 3, 3, 6, 6, 8, 8),
    Problem((), 3, 3, 6, 6, 8, 8, "causal"),
    Problem((), 3, 3, 6, 9, 8, 8, "float", (6, 9)),
    Problem((), 3, 3, 6, 9, 8, 8, "bool", (3, 6, 9)),
    # 4-D, value head dim != qk head dim, float masks broadcast every way SDPA allows;
    # each broadcast dim makes dmask a sum over that dim
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", ()),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (7,)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (5, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (1, 5, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (2, 1, 5, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 1, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 5, 7)),
    # a bias constant along each row shifts no probability: its true gradient is ~0
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 5, 1)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "bool", (7,)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 1, 5, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 4, 1, 7)),
    # scale given (not a power of two, and one above 1 that sharpens the softmax)
    Problem((2,), 4, 4, 5, 7, 8, 6, "none", scale=0.3),
    Problem((2,), 4, 4, 5, 7, 8, 6, "causal", scale=1.7),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (5, 7), scale=0.3),
    # enable_gqa
    Problem((2,), 4, 2, 5, 7, 8, 6),
    Problem((2,), 6, 2, 5, 7, 8, 6, "causal"),
    Problem((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)),
    Problem((2,), 4, 2, 5, 7, 8, 6, "float", (2, 4, 1, 7)),
    Problem((2,), 4, 1, 5, 7, 8, 6, "bool", (2, 1, 5, 7)),  # one k/v head for all
    # 5-D: two lead dims, masks broadcast over some of them
    Problem((2, 3), 2, 1, 4, 9, 8, 8, "float", (3, 1, 4, 9)),
    Problem((2, 3), 2, 2, 4, 9, 8, 8, "float", (2, 1, 1, 1, 9)),
    Problem((2, 3), 2, 2, 4, 9, 8, 8, "bool", (2, 3, 2, 4, 9)),
    Problem((2, 3), 4, 2, 4, 9, 8, 5, "causal"),
    # is_causal with Nq != Nk: SDPA aligns the mask to the top-left corner
    Problem((2,), 2, 2, 9, 4, 8, 8, "causal"),
    Problem((2,), 2, 2, 4, 9, 8, 8, "causal"),
    Problem((2,), 4, 2, 9, 4, 8, 6, "causal"),
    Problem((2,), 4, 2, 4, 9, 8, 6, "causal"),
]


@by_tensor_strategy
@pytest.mark.parametrize("pb", SDPA_CASES, ids=lambda pb: pb.id)
def test_matches_sdpa_math_float64(strategy, pb):
    inputs = make_problem_inputs(pb)
    got = run_problem(strategy_fn(strategy), pb, inputs)
    want = run_problem(sdpa_math, pb, inputs)
    assert_close_f64(got, want, tol=1e-9)


def test_auto_strategy_matches_sdpa_math():
    pb = Problem((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7))
    inputs = make_problem_inputs(pb)
    got = run_problem(strategy_fn("auto"), pb, inputs)
    assert_close_f64(got, run_problem(sdpa_math, pb, inputs))


@by_strategy
def test_non_contiguous_inputs_match_sdpa(strategy):
    # Models keep q/k/v as [B, N, H, d] and transpose to [B, H, N, d]; k/v may be
    # expanded views (stride 0) and the mask a transposed view.  Any .view() on a
    # caller's tensor would raise or misread here.
    f64 = dict(dtype=torch.float64)
    q = torch.randn(2, 5, 4, 8, **f64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, 2, 8, **f64).transpose(1, 2).requires_grad_()
    v = torch.randn(1, 2, 7, 6, **f64).expand(2, 2, 7, 6).requires_grad_()
    mask = torch.randn(4, 7, 5, **f64).transpose(-1, -2).requires_grad_()
    dout = torch.randn(2, 4, 5, 6, **f64).transpose(-1, -2).contiguous().transpose(-1, -2)
    leaves = (q, k, v, mask)
    out = attngrad.attention(q, k, v, mask, enable_gqa=True, strategy=strategy)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = sdpa_math(q, k, v, mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-9)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-9)


@by_strategy
@pytest.mark.parametrize(
    ("nq", "nk", "b"),
    [(4, 0, 2), (0, 4, 2), (4, 4, 0)],
    ids=["no-keys", "no-queries", "no-batch"],
)
def test_empty_dims_match_sdpa(strategy, nq, nk, b):
    # with no keys every row attends nothing: SDPA gives zeros, not NaN
    q = torch.randn(b, 2, nq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, nk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, nk, 6, dtype=torch.float64, requires_grad=True)
    out = attngrad.attention(q, k, v, strategy=strategy)
    ref = sdpa_math(q, k, v)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


# ---------------------------------------------------------------------------
# the 2x rule in float32, bfloat16, float16

# The bound is the harness's own (`attngrad.verify.two_x_bound`): the floor is
# one ulp of the reference's magnitude for bf16/fp16 and eight for float32,
# where the plain-PyTorch baseline is itself a few ulps and the max over
# thousands of elements of two such rounding noises has a heavy tail.

TWO_X_CASES = [
    Problem((2,), 4, 2, 97, 97, 59, 59),  # d = 59: 1/sqrt(d) is inexact
    Problem((2,), 4, 2, 97, 97, 59, 59, "causal"),
    Problem((1,), 2, 2, 33, 200, 16, 24, "bool", (1, 1, 33, 200)),
    Problem((1,), 4, 4, 64, 128, 64, 64, "float", (4, 64, 128)),
    Problem((), 3, 3, 7, 1, 8, 8, "causal"),  # one key: P is exactly one
]


@by_tensor_strategy
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("pb", TWO_X_CASES, ids=lambda pb: pb.id)
def test_two_x_rule(strategy, dtype, pb):
    """Error vs float64 <= 2 x the error of plain PyTorch in the same dtype + a floor."""
    inputs = make_problem_inputs(pb)
    ref = run_problem(reference_attention, pb, inputs, torch.float64)
    base = run_problem(reference_attention, pb, inputs, dtype)
    got = run_problem(strategy_fn(strategy), pb, inputs, dtype)
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        assert got[name].dtype == dtype
        assert not got[name].isnan().any(), f"{name} has NaN"
        err, base_err = max_abs_err(got[name], r), max_abs_err(base[name], r)
        bound = two_x_bound(base_err, dtype, float(r.abs().max()) if r.numel() else 0.0)
        assert err <= bound, (
            f"{name}: error {err:.3e} > 2 x {base_err:.3e} (plain PyTorch) + floor = {bound:.3e}"
        )


# Cases outside `attngrad check`'s default grid, judged by the harness itself.
HARNESS_CASES = [
    Case((3,), 6, 2, 29, 13, 40, 40, torch.float64, "float"),
    Case((2,), 2, 1, 5, 31, 12, 20, torch.bfloat16, "bool"),
    Case((), 4, 4, 50, 50, 32, 32, torch.float16, "causal"),
    Case((2,), 2, 2, 16, 16, 16, 16, torch.float32, "none"),
]


@by_strategy
@pytest.mark.parametrize("case", HARNESS_CASES, ids=lambda c: c.id)
def test_conformance_harness_cases(strategy, case):
    result = run_case(strategy, case)
    assert result.passed, (result.message, result.errors, result.bounds)
    assert set(result.errors) == {"out", "dq", "dk", "dv"} | (
        {"dmask"} if case.mask == "float" else set()
    )
    if case.dtype == torch.float64:
        assert result.gradcheck_passed is True


# ---------------------------------------------------------------------------
# rows that attend no key: zero output, zero (finite) gradients


def _dead_row_mask(kind: str, b: int, h: int, nq: int, nk: int, dtype: torch.dtype):
    """A [B, H, Nq, Nk] mask with query row 2 dead everywhere and row 4 dead in (b=0, h=1) only."""
    keep = torch.rand(b, h, nq, nk) > 0.3
    keep[..., :, 0] = True  # every other row keeps at least one key
    keep[..., 2, :] = False
    keep[0, 1, 4, :] = False
    if kind == "bool":
        return keep, keep
    bias = torch.randn(b, h, nq, nk, dtype=torch.float64)
    bias = bias.masked_fill(~keep, float("-inf")).to(dtype).requires_grad_()
    return bias, keep


@by_strategy
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("hkv", [4, 2], ids=["H4", "H4:2"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows(strategy, dtype, hkv, kind):
    b, hq, nq, nk, d = 2, 4, 6, 9, 8
    mask, keep = _dead_row_mask(kind, b, hq, nq, nk, dtype)
    dead = ~keep.any(dim=-1)  # [B, Hq, Nq]
    q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, dtype=dtype, requires_grad=True)
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    out = attngrad.attention(q, k, v, mask, enable_gqa=hkv != hq, strategy=strategy)
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))

    assert (out[dead] == 0).all(), "a dead row's output must be exactly 0"
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()
    dq = grads[0]
    assert (dq[dead] == 0).all()
    if kind == "float":
        dmask = grads[3]
        assert (dmask[dead] == 0).all()
        # -inf entries of live rows get no probability and so no gradient either
        assert (dmask[~keep] == 0).all()
    if dtype == torch.float64:
        ref = sdpa_math(q, k, v, mask, enable_gqa=hkv != hq)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-9)


@by_strategy
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_every_row_masked(strategy, kind):
    # the extreme case: nothing attends anything, so every gradient is zero
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    if kind == "bool":
        mask = torch.zeros(5, 5, dtype=torch.bool)
    else:
        mask = torch.full((5, 5), float("-inf"), dtype=torch.float64, requires_grad=True)
    out = attngrad.attention(q, k, v, mask, strategy=strategy)
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert (out == 0).all()
    for g in grads:
        assert (g == 0).all()


# ---------------------------------------------------------------------------
# any subset of inputs requiring grad

SUBSETS = [
    (),
    ("q",),
    ("k",),
    ("v",),
    ("mask",),
    ("q", "k"),
    ("k", "v"),
    ("q", "mask"),
    ("v", "mask"),
    ("q", "k", "v"),
    ("q", "k", "v", "mask"),
]


@by_strategy
@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "nothing")
def test_gradients_of_any_subset(strategy, subset):
    pb = Problem((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7))
    inputs = make_problem_inputs(pb)
    ref = run_problem(reference_attention, pb, inputs)
    leaves = {
        n: inputs[n].detach().clone().requires_grad_(n in subset)  # type: ignore[union-attr]
        for n in ("q", "k", "v", "mask")
    }
    out = attngrad.attention(
        leaves["q"], leaves["k"], leaves["v"], leaves["mask"], enable_gqa=True, strategy=strategy
    )
    torch.testing.assert_close(out.detach(), ref["out"], atol=1e-12, rtol=1e-9)
    if not subset:
        assert not out.requires_grad and out.grad_fn is None
        return
    out.backward(inputs["dout"])
    for name, t in leaves.items():
        if name in subset:
            assert t.grad is not None, f"{name} requires grad but got none"
            torch.testing.assert_close(t.grad, ref["d" + name], atol=1e-12, rtol=1e-9)
        else:
            assert t.grad is None, f"{name} does not require grad but got one"


# ---------------------------------------------------------------------------
# dtypes


@by_strategy
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_output_and_gradient_dtypes_follow_input(strategy, dtype, mask):
    pb = Problem((2,), 4, 2, 5, 7, 8, 6, mask, (4, 5, 7))
    inputs = make_problem_inputs(pb, dtype=dtype)
    got = run_problem(strategy_fn(strategy), pb, inputs)
    for name, t in got.items():
        assert t.dtype == dtype, f"{name} is {t.dtype}"
        assert not t.isnan().any(), f"{name} has NaN"


# ---------------------------------------------------------------------------
# what the explicit strategy saves for backward

SAVED_CASES = [
    Problem((2,), 4, 4, 5, 7, 8, 6),
    Problem((2,), 6, 2, 5, 7, 8, 6, "causal"),  # GQA: k, v saved unexpanded
    Problem((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)),  # the bias is not saved
    Problem((2,), 4, 2, 5, 7, 8, 6, "float", (2, 1, 1, 7)),
    Problem((), 3, 3, 6, 9, 8, 8, "bool", (6, 9)),  # the course chapter's [B, N, d] layout
    Problem((2, 3), 4, 1, 4, 9, 8, 8, "float", (3, 1, 4, 9)),  # two lead dims
]


@pytest.mark.skipif("explicit" not in STRATEGIES, reason="no explicit strategy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("pb", SAVED_CASES, ids=lambda pb: pb.id)
def test_explicit_saves_q_k_v_and_p_only(pb, dtype):
    inputs = make_problem_inputs(pb, dtype=dtype)
    q, k, v, mask = (inputs[n] for n in ("q", "k", "v", "mask"))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attngrad.attention(
            q, k, v, mask, is_causal=pb.mask == "causal", enable_gqa=pb.gqa, strategy="explicit"
        )

    batch = math.prod(pb.lead)
    hq, hkv, nq, nk, d, dv = (
        pb.heads_q,
        pb.heads_kv,
        pb.seq_q,
        pb.seq_k,
        pb.head_dim,
        pb.value_dim,
    )
    assert len(saved) == 4, [tuple(t.shape) for t in saved]
    rest = list(saved)
    for name, t in (("q", q), ("k", k), ("v", v)):
        same = [s for s in rest if s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()]
        assert len(same) == 1, f"{name} is not saved as itself (a copy or an expansion?)"
        s = same[0]
        assert s.numel() == t.numel()
        assert s.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        rest.remove(s)
    (p,) = rest
    assert p.shape == (batch, hq, nq, nk)  # one [Nq, Nk] matrix per query head, like SDPA's P
    assert p.dtype == dtype
    b = q.element_size()
    expected = b * (batch * hq * nq * d + batch * hkv * nk * d + batch * hkv * nk * dv)
    expected += b * batch * hq * nq * nk
    assert sum(t.numel() * t.element_size() for t in saved) == expected
    out.backward(inputs["dout"])  # the four saved tensors are enough for backward


# ---------------------------------------------------------------------------
# dropout and causal alignment


@by_strategy
@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.999])
def test_dropout_is_not_implemented(strategy, dropout_p):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        attngrad.attention(q, q, q, dropout_p=dropout_p, strategy=strategy)


@by_strategy
def test_dropout_zero_is_accepted(strategy):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    for p in (0.0, 0):
        torch.testing.assert_close(
            attngrad.attention(q, q, q, dropout_p=p, strategy=strategy), sdpa_math(q, q, q)
        )


@by_strategy
@pytest.mark.parametrize(("nq", "nk"), [(9, 4), (4, 9)], ids=["Nq9>Nk4", "Nq4<Nk9"])
def test_causal_is_aligned_top_left(strategy, nq, nk):
    f64 = dict(dtype=torch.float64)
    q, k = torch.randn(2, 3, nq, 8, **f64), torch.randn(2, 3, nk, 8, **f64)
    v = torch.randn(2, 3, nk, 5, **f64)
    out = attngrad.attention(q, k, v, is_causal=True, strategy=strategy)
    # top-left: query 0 sees key 0 only (bottom-right would let it see nk - nq + 1 keys)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :], atol=1e-12, rtol=0)
    # query i >= Nk - 1 sees every key: the same as no mask at all
    full = attngrad.attention(q, k, v, strategy=strategy)
    torch.testing.assert_close(out[..., nk - 1 :, :], full[..., nk - 1 :, :])
    torch.testing.assert_close(out, sdpa_math(q, k, v, is_causal=True), atol=1e-12, rtol=1e-9)
