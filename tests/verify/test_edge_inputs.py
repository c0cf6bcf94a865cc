"""Inputs real models send, at the edges: each test names the bug it guards against.

Every check is the harness's one rule (`attngrad.verify.rule`), on every strategy
and dtype, and on the tiled strategies at small tiles too (`helpers.SMALL_TILES`:
the sequences here span several, so the tiles' merge meets the edge values);
where the math fixes the answer exactly (one-hot and uniform rows, an empty
row) the answer is pinned by name.

Every run (strategy, tiles) of a test sees the same inputs: each test builds
them in a cached function that returns their expectation (`expect`: the float64
reference, the plain run and the bounds), computed once and shared by the runs.
"""

from __future__ import annotations

import functools

import pytest
import torch

import attngrad
from attngrad.core.contract import Shapes
from attngrad.verify.cases import Case, make_inputs, outputs_and_grads
from attngrad.verify.rule import (
    Expected,
    expect,
    judge,
    judge_run,
    kept_bound,
    rounding_floor,
    terms,
)
from helpers import (
    StrictRule,
    assert_passed,
    attention_fn,
    blind_to_zeros,
    run_id,
    runs,
    zeros_like,
)

STRATEGIES = attngrad.STRATEGIES
# (strategy, tiles): every strategy at its own tiles, the tiled ones at small tiles (`runs`)
RUNS = runs(STRATEGIES)
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# the dtypes where finfo.min swallows any score q k^T of ordinary size (|finfo.min| u >> |q k^T|)
SWALLOWING = (torch.float64, torch.float32, torch.bfloat16)

by_run = pytest.mark.parametrize("run", RUNS, ids=run_id)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(expected: Expected, run: tuple[str, tuple[int, int] | None]) -> dict[str, torch.Tensor]:
    """Out and every gradient of ``run`` on the expectation's inputs, in the case's dtype."""
    return outputs_and_grads(
        attention_fn(*run), expected.case, expected.inputs, expected.case.dtype
    )


def _assert_rule(
    expected: Expected, run: tuple[str, tuple[int, int] | None]
) -> dict[str, torch.Tensor]:
    got = _run(expected, run)
    for name, g in got.items():
        assert torch.isfinite(g).all(), f"{name} is not finite"
    assert_passed(judge_run(expected, got))
    return got


# (window, the row it leaves with the dropped keys only, the keys the mask drops), at N = 20
EMPTIED = [
    ((None, 0), 0, (0,)),
    ((None, 2), 0, (0, 1, 2)),
    ((1, None), 19, (18, 19)),
    ((1, 1), 0, (0, 1)),
]


@functools.cache
def _emptied(window: tuple[int | None, int | None], dropped: tuple[int, ...]) -> Expected:
    case = Case(Shapes((1,), 2, 2, 20, 20, 8, 8), torch.float64, "bool", window=window)
    inputs = make_inputs(case)
    keep = torch.ones(20, 20, dtype=torch.bool)
    keep[:, dropped] = False
    inputs["mask"] = keep
    return expect(case, inputs)


@by_run
@pytest.mark.parametrize(("window", "row", "dropped"), EMPTIED, ids=lambda x: str(x))
def test_a_row_that_window_and_mask_empty_together_is_zero(run, window, row, dropped):
    # regression: dead rows were looked up in the band only when its left side
    # was bounded, so window=(None, 0) with a mask dropping key 0 gave NaN
    got = _assert_rule(_emptied(window, dropped), run)
    assert (got["out"][..., row, :] == 0).all()
    assert (got["dq"][..., row, :] == 0).all()
    # and every other row is live: the dead one sits beside rows that attend
    others = [i for i in range(20) if i != row]
    assert got["out"][..., others, :].ne(0).any(dim=-1).all()


@functools.cache
def _row_at_finfo_min(dtype: torch.dtype) -> Expected:
    case = Case(Shapes((2,), 2, 2, 16, 21, 8, 4), dtype, "float", mask_shape=(16, 21))
    inputs = make_inputs(case)
    inputs["mask"][1] = torch.finfo(dtype).min  # row 1 masks "everything" with a number
    return expect(case, inputs)


@by_run
@pytest.mark.parametrize("dtype", SWALLOWING, ids=_name)
def test_a_row_at_finfo_min_is_uniform(run, dtype):
    # regression: flash and triton scaled the bias by log2(e) before subtracting
    # the row max, so finfo.min overflowed to -inf and the row came out empty;
    # recompute rebuilt P from one float lse that had rounded log(Nk) away
    expected = _row_at_finfo_min(dtype)
    got = _assert_rule(expected, run)
    v = expected.inputs["v"].to(dtype).double()
    uniform = v.mean(dim=-2)  # [B, H, dv]: softmax of equal scores
    floor = rounding_floor(v.abs().mean(dim=-2), torch.zeros_like(uniform), dtype, 21, 8)
    verdict = judge("out", got["out"][..., 1, :], uniform, floor)
    assert verdict.passed, str(verdict)


@functools.cache
def _biases_at_the_edge(dtype: torch.dtype, fill: str) -> Expected:
    case = Case(Shapes((1,), 2, 1, 16, 21, 8, 8), dtype, "float", mask_shape=(2, 16, 21))
    inputs = make_inputs(case)
    mask = inputs["mask"]
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(1)
    some = torch.rand(mask.shape, generator=gen) < 0.4
    if fill == "min-some":
        mask[some] = info.min
    elif fill == "max-one":
        # times log2(e) it would overflow; in a later key tile than the row's first max
        mask[0, 3, 18] = info.max * 0.8
    else:
        mask[some] = max(-1e9, info.min)
    return expect(case, inputs)


@by_run
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(
    "fill", ["min-some", "max-one", "minus-1e9"], ids=["finfo-min-some", "huge-one", "minus-1e9"]
)
def test_biases_at_the_edge_of_the_dtype(run, dtype, fill):
    # regression: a single +1.5e308 entry (float64) gave NaN in flash; at -1e9
    # in float32 the tiled backward was 30x off plain PyTorch
    _assert_rule(_biases_at_the_edge(dtype, fill), run)


def _spread(case: Case, spread: float) -> Expected:
    """The case's inputs with q and k scaled by ``spread``: scores of spread^2 sqrt(d)."""
    inputs = make_inputs(case)
    inputs["q"] = inputs["q"] * spread
    inputs["k"] = inputs["k"] * spread
    return expect(case, inputs)


@functools.cache
def _large_logits(dtype: torch.dtype, spread: float) -> Expected:
    return _spread(Case(Shapes((2,), 2, 2, 19, 23, 16, 8), dtype, "causal"), spread)


@by_run
@pytest.mark.parametrize(
    ("dtype", "spread"),
    [(torch.float64, 100.0), (torch.float32, 30.0), (torch.bfloat16, 30.0), (torch.float16, 8.0)],
    ids=["float64", "float32", "bfloat16", "float16"],
)
def test_large_logits(run, dtype, spread):
    # regression: P was rebuilt from an lse converted between bases, so its
    # largest entry was no longer 1; saturated rows turned that into gradient
    # errors 25-54x plain PyTorch's.  |S| reaches spread^2 * sqrt(d) (~1e4)
    expected = _large_logits(dtype, spread)
    got = _assert_rule(expected, run)
    # The plain bfloat16 run is so far off here that the 2x term passes an all-zero dk: where
    # the rule cannot tell zeros, the rule without its 2x term judges (scores stay in float32)
    # and must tell them.  Every quantity is then checked by a judgement that rejects zeros.
    blind = blind_to_zeros(expected.case, expected.inputs, got, expected)
    strict = StrictRule(expected.ref, expected.floors, expected.kept)
    assert_passed(strict.judge({n: got[n] for n in blind}), "without the 2x term: ")
    told = [v.name for v in strict.judge(zeros_like({n: got[n] for n in blind})) if not v.passed]
    assert sorted(told) == sorted(blind), "zeros pass even without the 2x term"


# (run, spread of q and k, N): every run at N = 50, and triton at its own tiles too (forward,
# dK/dV and dQ each in tiles of another shape); at N = 300 every strategy at its own tiles
# (several of them; small tiles there add only time: triton's 16 x 16 take 30 s)
LARGE_LOGITS = [
    pytest.param(run, spread, n, id=f"{run_id(run)}-x{spread:g}-N{n}")
    for spread, n, runs_at in (
        (100.0, 50, [*RUNS, ("triton", None)]),
        (8.0, 300, [(s, None) for s in STRATEGIES]),
    )
    for run in runs_at
]


@functools.cache
def _scores_in_the_thousands(spread: float, n: int) -> Expected:
    return _spread(Case(Shapes((1,), 2, 2, n, n, 64, 64), torch.float32), spread)


@pytest.mark.parametrize(("run", "spread", "n"), LARGE_LOGITS)
def test_float32_scores_in_the_thousands_hold_the_rule(run, spread, n):
    # regression: triton's dK/dV kernel formed its scores as k q^T and its dQ kernel in other
    # tile shapes; numpy's BLAS (Triton's interpreter) rounds those differently on some CPUs
    # (OPENBLAS_CORETYPE=Haswell), and at |S| ~ 3e4 (ulp 2e-3) a score one unit off made a
    # one-hot row's P 1.002: dv 2,000x its bound.  The rule's floor lets a score move only
    # as one rounding does, P and the row's sum alike (bounds._probability_move)
    _assert_rule(_scores_in_the_thousands(spread, n), run)


@functools.cache
def _float16_at_its_max() -> Expected:
    case = Case(Shapes((1,), 2, 2, 30, 30, 16, 16), torch.float16)
    inputs = make_inputs(case)
    gen = torch.Generator().manual_seed(3)
    for name in ("q", "k", "v", "dout"):
        t = inputs[name]
        inputs[name] = (torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2 - 1) * 6e4
    return expect(case, inputs)


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(
            r,
            marks=pytest.mark.xfail(
                r == ("flash", (7, 5)),
                reason="flash forms Delta (einsum) and dP (matmul) in other shapes; at 7x5 "
                "tiles torch's BLAS rounds them apart on this input and dq overflows",
            ),
        )
        for r in RUNS
    ],
    ids=run_id,
)
def test_float16_inputs_at_its_max_keep_exact_zeros(run):
    # regression: triton formed Delta = rowsum(O * dO) in another order than dP = dO v^T, so
    # on one-hot rows (every row, at |S| ~ 1e10) dS = P (dP - Delta) kept |dP| u ~ 1e3 where
    # it is 0, and dq, dk = s dS k overflowed float16: inf where the answer is exactly 0
    expected = _float16_at_its_max()
    got = _run(expected, run)
    ref = expected.ref
    assert (ref["dq"] == 0).all() and (ref["dk"] == 0).all()  # every row one-hot
    assert (got["dq"] == 0).all() and (got["dk"] == 0).all()
    assert torch.equal(got["out"], ref["out"].half())  # O = the row's v, exactly
    # dv sums up to 30 rows of dO at 6e4: past float16's range where its reference is
    fits = ref["dv"].abs() < torch.finfo(torch.float16).max
    assert got["dv"][fits].isfinite().all()
    assert_passed(judge_run(expected, got, names={"out", "dq", "dk"}))


# -- exact answers: a one-hot row and uniform rows ------------------------------------

# a bias that no ordinary score reaches: exp(-HUGE) is 0 in every compute dtype, so the row's
# P is exactly one-hot (1 and 0), and it stays finite in float16
HUGE = 1e4


# the row and the key it puts all its weight on
ONE_HOT = (5, 18)


@functools.cache
def _one_huge_bias(dtype: torch.dtype) -> Expected:
    row, key = ONE_HOT
    case = Case(Shapes((2,), 2, 2, 16, 21, 8, 6), dtype, "float", mask_shape=(2, 16, 21))
    inputs = make_inputs(case)
    inputs["mask"][:, :, key] = float("-inf")
    inputs["mask"][:, row, key] = HUGE
    return expect(case, inputs)


@by_run
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_a_row_with_one_huge_bias_is_one_hot(run, dtype):
    # row 5 puts all its weight on key 18 (a later key tile than its first), which no other
    # row sees: out[5] = v[18] and dv[18] = dO[5] bit for bit (sums of one term times 1 and
    # zeros), and dS[5] = P (dP - Delta) = 0, so dq[5] and dmask[:, 5] vanish to the floor
    row, key = ONE_HOT
    expected = _one_huge_bias(dtype)
    case, inputs = expected.case, expected.inputs
    got = _assert_rule(expected, run)
    q, k, v, dout = (inputs[n].to(dtype) for n in ("q", "k", "v", "dout"))
    assert torch.equal(got["out"][..., row, :], v[..., key, :])
    assert torch.equal(got["dv"][..., key, :], dout[..., row, :])
    # dS[5, 18] = dP - Delta, two dv-term products dO[5] . v[18] (Delta's with O[5] = v[18])
    # formed apart: each off by its sum's rounding, the difference kept once in the dtype
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    a_ds = 2 * (dout[..., row, :].abs() * v[..., key, :].abs()).sum(-1)  # [B, H]
    a_dq = case.shapes.head_dim**-0.5 * a_ds[..., None] * k[..., key, :].abs()
    a_dmask = torch.zeros_like(got["dmask"][:, row, :], dtype=torch.float64)
    a_dmask[:, key] = a_ds.sum(0)  # the mask is shared across the batch: dmask sums it
    for name, got_x, a in (
        ("dq", got["dq"][..., row, :], a_dq),
        ("dmask", got["dmask"][:, row, :], a_dmask),
    ):
        floor = rounding_floor(a, torch.zeros_like(a), dtype, case.shapes.value_dim, 8)
        assert_passed([judge(name, got_x, torch.zeros_like(a), floor)])


@functools.cache
def _equal_scores(dtype: torch.dtype) -> Expected:
    case = Case(Shapes((2,), 2, 2, 16, 21, 8, 6), dtype)
    inputs = make_inputs(case)
    inputs["q"] = torch.zeros_like(inputs["q"])
    inputs["k"] = inputs["k"][..., :1, :].expand_as(inputs["k"]).clone()
    return expect(case, inputs)


@by_run
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_equal_scores_give_the_mean(run, dtype):
    # q = 0 and every key alike: every score is exactly 0, P = 1 / Nk everywhere.  Then
    # out = mean of v, dv[j] = sum_i dO[i] / Nk for every key, dk = s dS^T q = 0 exactly,
    # and dq = s sum_j dS[i, j] k[j] = s k[0] rowsum(dS) = 0, as each row of dS sums to 0
    expected = _equal_scores(dtype)
    case, inputs = expected.case, expected.inputs
    got = _assert_rule(expected, run)
    assert (got["dk"] == 0).all()
    v, dout = (inputs[n].to(dtype).double() for n in ("v", "dout"))
    n = terms(case)
    for name, terms_x in (("out", v), ("dv", dout)):
        # a sum of P x = x / Nk over keys (out) or rows (dv); P = 1 / Nk kept in the dtype moves
        # each term by u of itself: kept_bound of the sum of the terms' sizes
        mean = terms_x.sum(-2, keepdim=True) / 21
        size = terms_x.abs().sum(-2, keepdim=True) / 21
        want, got_x = mean.expand_as(got[name]), got[name]
        floor = rounding_floor(size, torch.zeros_like(size), dtype, n, 8).expand_as(got_x)
        kept = kept_bound(size, dtype).expand_as(got_x)
        assert_passed([judge(name, got_x, want, floor, kept=kept)])
    # dq: the rule's own floor and kept bound (the sums dP, Delta and dS k, O read back,
    # dS kept in the dtype), around the exact answer 0 rather than the float64 one
    zero = torch.zeros_like(expected.ref["dq"])
    assert_passed([judge("dq", got["dq"], zero, expected.floors["dq"], kept=expected.kept["dq"])])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.float16, 6e4), (torch.bfloat16, 1e5)], ids=["float16", "bfloat16"]
)
def test_16_bit_values_near_their_range_stay_finite(strategy, dtype, value):
    # regression: float16 q, k near 6e4 gave NaN dq/dk in flash and triton
    q = torch.full((1, 1, 4, 2), value, dtype=dtype, requires_grad=True)
    k = torch.full((1, 1, 4, 2), value, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 1, 4, 2).to(dtype).requires_grad_()
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.backward(torch.ones_like(out))
    for t in (out, q.grad, k.grad, v.grad):
        assert not t.isnan().any()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_nan_row_stays_nan_in_backward(strategy, dtype):
    # regression: recompute turned a NaN row of the forward into a dead row in
    # backward and hid the NaN; SDPA propagates it, so must every strategy (float32
    # too, where fused's polynomial exp would clamp a NaN to a finite number)
    q = torch.randn(1, 2, 5, 4, dtype=dtype)
    q[0, 0, 2, 0] = float("nan")
    q.requires_grad_()
    k, v = (torch.randn(1, 2, 5, 4, dtype=dtype, requires_grad=True) for _ in range(2))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.sum().backward()
    assert out[0, 0, 2].isnan().all() and not out[0, 1].isnan().any()
    assert q.grad[0, 0, 2].isnan().all() and v.grad[0, 0].isnan().any()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_nan_key_in_a_later_tile_makes_every_row_nan(strategy, dtype):
    # a row's running max is finite from its first tiles; a NaN score in a later one must
    # still reach the output (fused's exp skips NaN care on rows whose max is finite)
    q, k, v = (torch.randn(1, 2, 37, 4, dtype=dtype) for _ in range(3))
    k[0, 1, 30, 2] = float("nan")
    size = {"flash": 8, "fused": 8, "triton": 16}.get(strategy)  # several key tiles
    tiles = {} if size is None else {"block_q": size, "block_k": size}
    out = attngrad.attention(q, k, v, strategy=strategy, **tiles)
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any()


@pytest.mark.parametrize("strategy", ["explicit", "recompute"])
def test_the_output_can_be_edited_in_place(strategy):
    # regression: forward returned a view, so o.add_(1) raised "Output 0 of View
    # ... created inside a custom Function"; SDPA MATH allows it
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.add_(1)
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("strategy", ["flash", "fused", "triton"])
def test_editing_a_saved_output_is_refused_by_autograd(strategy):
    # flash and triton save O for backward (Delta = rowsum(dO * O)), as PyTorch's
    # flash kernel does: editing it in place must be caught, never silently used
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
