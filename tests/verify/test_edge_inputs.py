"""Inputs real models send, at the edges: each test names the bug it guards against.

Every check is the harness's one rule (`attngrad.verify.rule`), on every strategy
and dtype; where the math fixes the answer exactly (a uniform row, an empty
row) the answer is pinned by name.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.core.contract import Shapes
from attngrad.verify.cases import Case, make_inputs, outputs_and_grads
from attngrad.verify.check import strategy_fn
from attngrad.verify.rule import judge, judge_outputs, rounding_floor

STRATEGIES = attngrad.STRATEGIES
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# the dtypes where finfo.min swallows any score q k^T of ordinary size (|finfo.min| u >> |q k^T|)
SWALLOWING = (torch.float64, torch.float32, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _assert_rule(case: Case, inputs: dict, strategy: str) -> dict[str, torch.Tensor]:
    got = outputs_and_grads(strategy_fn(strategy), case, inputs, case.dtype)
    for name, g in got.items():
        assert torch.isfinite(g).all(), f"{name} is not finite"
    failed = [str(v) for v in judge_outputs(case, inputs, got) if not v.passed]
    assert not failed, failed
    return got


# (window, the row it leaves with the dropped keys only, the keys the mask drops)
EMPTIED = [
    ((None, 0), 0, [0]),
    ((None, 2), 0, [0, 1, 2]),
    ((1, None), 5, [4, 5]),
    ((1, 1), 0, [0, 1]),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("window", "row", "dropped"), EMPTIED, ids=lambda x: str(x))
def test_a_row_that_window_and_mask_empty_together_is_zero(strategy, window, row, dropped):
    # regression: dead rows were looked up in the band only when its left side
    # was bounded, so window=(None, 0) with a mask dropping key 0 gave NaN
    case = Case(Shapes((1,), 2, 2, 6, 6, 8, 8), torch.float64, "bool", window=window)
    inputs = make_inputs(case)
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[:, dropped] = False
    inputs["mask"] = keep
    got = _assert_rule(case, inputs, strategy)
    assert (got["out"][..., row, :] == 0).all()
    assert (got["dq"][..., row, :] == 0).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", SWALLOWING, ids=_name)
def test_a_row_at_finfo_min_is_uniform(strategy, dtype):
    # regression: flash and triton scaled the bias by log2(e) before subtracting
    # the row max, so finfo.min overflowed to -inf and the row came out empty;
    # recompute rebuilt P from one float lse that had rounded log(Nk) away
    case = Case(Shapes((2,), 2, 2, 5, 7, 8, 4), dtype, "float", mask_shape=(5, 7))
    inputs = make_inputs(case)
    inputs["mask"][1] = torch.finfo(dtype).min  # row 1 masks "everything" with a number
    got = _assert_rule(case, inputs, strategy)
    v = inputs["v"].to(dtype).double()
    uniform = v.mean(dim=-2)  # [B, H, dv]: softmax of equal scores
    floor = rounding_floor(v.abs().mean(dim=-2), torch.zeros_like(uniform), dtype, 7, 8)
    verdict = judge("out", got["out"][..., 1, :], uniform, floor)
    assert verdict.passed, str(verdict)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(
    "fill", ["min-some", "max-one", "minus-1e9"], ids=["finfo-min-some", "huge-one", "minus-1e9"]
)
def test_biases_at_the_edge_of_the_dtype(strategy, dtype, fill):
    # regression: a single +1.5e308 entry (float64) gave NaN in flash; at -1e9
    # in float32 the tiled backward was 30x off plain PyTorch
    case = Case(Shapes((1,), 2, 1, 9, 11, 8, 8), dtype, "float", mask_shape=(2, 9, 11))
    inputs = make_inputs(case)
    mask = inputs["mask"]
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(1)
    some = torch.rand(mask.shape, generator=gen) < 0.4
    if fill == "min-some":
        mask[some] = info.min
    elif fill == "max-one":
        mask[0, 3, 4] = info.max * 0.8  # times log2(e) it would overflow
    else:
        mask[some] = max(-1e9, info.min)
    _assert_rule(case, inputs, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("dtype", "spread"),
    [(torch.float64, 100.0), (torch.float32, 30.0), (torch.bfloat16, 30.0), (torch.float16, 8.0)],
    ids=["float64", "float32", "bfloat16", "float16"],
)
def test_large_logits(strategy, dtype, spread):
    # regression: P was rebuilt from an lse converted between bases, so its
    # largest entry was no longer 1; saturated rows turned that into gradient
    # errors 25-54x plain PyTorch's.  |S| reaches spread^2 * sqrt(d) (~1e4)
    case = Case(Shapes((2,), 2, 2, 13, 17, 16, 8), dtype, "causal")
    inputs = make_inputs(case)
    inputs["q"] = inputs["q"] * spread
    inputs["k"] = inputs["k"] * spread
    _assert_rule(case, inputs, strategy)


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
def test_a_nan_row_stays_nan_in_backward(strategy):
    # regression: recompute turned a NaN row of the forward into a dead row in
    # backward and hid the NaN; SDPA propagates it, so must every strategy
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    q[0, 0, 2, 0] = float("nan")
    q.requires_grad_()
    k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.sum().backward()
    assert out[0, 0, 2].isnan().all() and not out[0, 1].isnan().any()
    assert q.grad[0, 0, 2].isnan().all() and v.grad[0, 0].isnan().any()


@pytest.mark.parametrize("strategy", ["explicit", "recompute"])
def test_the_output_can_be_edited_in_place(strategy):
    # regression: forward returned a view, so o.add_(1) raised "Output 0 of View
    # ... created inside a custom Function"; SDPA MATH allows it
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.add_(1)
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("strategy", ["flash", "triton"])
def test_editing_a_saved_output_is_refused_by_autograd(strategy):
    # flash and triton save O for backward (Delta = rowsum(dO * O)), as PyTorch's
    # flash kernel does: editing it in place must be caught, never silently used
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy=strategy)
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
