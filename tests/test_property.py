"""Property test: on random shapes, masks and GQA layouts, float64 output and
gradients of every strategy match the reference and SDPA MATH to 1e-9, with no NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngrad.reference import reference_attention
from helpers import (
    TENSOR_STRATEGIES,
    Problem,
    assert_close_f64,
    make_problem_inputs,
    run_problem,
    sdpa_math,
)
from helpers import strategy_fn as bind_strategy


@st.composite
def problems(draw: st.DrawFn) -> tuple[Problem, bool, int]:
    """(problem, enable_gqa, seed).

    The mask shape is the score shape [*lead, Hq, Nq, Nk] with some leading
    dims dropped and any kept dim possibly 1: every broadcast SDPA accepts.
    """
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    heads_kv = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    seq_q, seq_k = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    head_dim, value_dim = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    mask = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    score = (*lead, heads_kv * groups, seq_q, seq_k)
    kept = draw(st.integers(0, len(score)))
    mask_shape = tuple(1 if draw(st.booleans()) else n for n in score[len(score) - kept :])
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    # enable_gqa=True is also valid with equal head counts (groups == 1)
    enable_gqa = groups > 1 or draw(st.booleans())
    pb = Problem(
        lead,
        heads_kv * groups,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
        mask,
        mask_shape if mask in ("bool", "float") else None,
        scale,
    )
    return pb, enable_gqa, draw(st.integers(0, 2**32 - 1))


def _gqa(fn, enable_gqa):
    def call(*args, **kwargs):
        kwargs["enable_gqa"] = enable_gqa
        return fn(*args, **kwargs)

    return call


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@settings(
    max_examples=80,
    deadline=None,
    # the autouse seed fixture runs once per test, not per example; harmless
    # here because every example seeds its own generator
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=problems())
def test_matches_reference_and_sdpa(strategy, case):
    pb, enable_gqa, seed = case
    inputs = make_problem_inputs(pb, gen=torch.Generator().manual_seed(seed))
    got = run_problem(_gqa(bind_strategy(strategy), enable_gqa), pb, inputs)
    ref = run_problem(_gqa(reference_attention, enable_gqa), pb, inputs)
    sdpa = run_problem(_gqa(sdpa_math, enable_gqa), pb, inputs)
    assert_close_f64(got, ref, tol=1e-9)
    assert_close_f64(got, sdpa, tol=1e-9)
