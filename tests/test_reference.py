"""The reference every strategy is judged against must itself be right:
float64 agreement with SDPA's MATH backend, and a genuine same-dtype
computation when run in low precision (or the 2x rule would be vacuous).

Both are judged by the rule's floor alone (`helpers.assert_floor`): the 2x
term would compare SDPA MATH with itself, which is the plain float64 run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attngrad.reference import plain_attention, reference_attention
from attngrad.verify import make_inputs, outputs_and_grads
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
    inputs = make_inputs(c)
    exact = outputs_and_grads(reference_attention, c, inputs, torch.float64)
    low = outputs_and_grads(reference_attention, c, inputs, dtype)
    for name, t in low.items():
        assert t.dtype == dtype, name
        assert not torch.equal(t.double(), exact[name]), f"{name} has no rounding error"
    # and its error is the rounding of a correct computation: within the rule's floor
    assert_floor(c, inputs, low, exact)


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
