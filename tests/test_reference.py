"""The reference every strategy is judged against must itself be right:
float64 agreement with SDPA's MATH backend, and a genuine same-dtype
computation when run in low precision (or the 2x rule would be vacuous).
"""

from __future__ import annotations

import pytest
import torch

from attngrad.reference import reference_attention
from helpers import (
    Problem,
    assert_close_f64,
    dtype_name,
    make_problem_inputs,
    max_abs_err,
    run_problem,
    sdpa_math,
)

CASES = [
    Problem((), 3, 3, 6, 9, 8, 8),  # the course chapter's [B, N, d] layout
    Problem((2,), 4, 4, 5, 7, 8, 6, "causal"),
    Problem((2,), 4, 4, 9, 4, 8, 6, "causal"),  # Nq > Nk, top-left aligned
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (7,)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "float", (2, 1, 5, 7)),
    Problem((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 4, 1, 7)),
    Problem((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7), scale=0.3),
    Problem((2,), 6, 2, 5, 7, 8, 6, "bool", (5, 7)),
    Problem((2, 3), 4, 1, 4, 9, 8, 5, "float", (3, 1, 4, 9)),
]


REFERENCE_PARAMS = [pytest.param(pb, False, id=pb.id) for pb in CASES] + [
    # a query row that attends nothing: SDPA MATH gives zeros there, so must the reference
    pytest.param(pb, True, id=pb.id + "-dead-row")
    for pb in CASES
    if pb.mask in ("bool", "float") and len(pb.mask_shape) >= 2 and pb.mask_shape[-2] > 1
]


@pytest.mark.parametrize(("pb", "dead_row"), REFERENCE_PARAMS)
def test_reference_matches_sdpa_math_float64(pb, dead_row):
    inputs = make_problem_inputs(pb, dead_row=dead_row)
    assert_close_f64(
        run_problem(reference_attention, pb, inputs), run_problem(sdpa_math, pb, inputs)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_name)
def test_reference_computes_in_the_input_dtype(dtype):
    # the 2x rule compares against "plain PyTorch in the same dtype": a reference
    # that silently upcast would have ~zero error and fail every honest kernel
    pb = Problem((2,), 4, 2, 33, 47, 59, 24, "float", (4, 33, 47))
    inputs = make_problem_inputs(pb)
    exact = run_problem(reference_attention, pb, inputs, torch.float64)
    low = run_problem(reference_attention, pb, inputs, dtype)
    eps = torch.finfo(dtype).eps
    for name, r in exact.items():
        assert low[name].dtype == dtype
        err = max_abs_err(low[name], r)
        assert 0 < err < 1e3 * eps * max(1.0, float(r.abs().max())), (name, err)
