"""The conformance harness must catch broken implementations, not only pass good ones.

Each broken function below is one of the mistakes a hand-written backward
makes (the mistakes a learner's implementation typically makes); `run_case` must fail it.
Every run here is judged by its case's expectation (`expect_case`), computed once
per case and shared by the runs on it, as `attngrad check` does.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from attngrad.verify.cases import (
    DROPOUT_SEED,
    as_attention,
    default_cases,
    dropout_mask,
    long_cases,
    make_inputs,
    outputs_and_grads,
)
from attngrad.verify.check import (
    SLOW_GRADGRADCHECK,
    CaseResult,
    expect_case,
    run_case,
    strategy_fn,
)
from attngrad.verify.derivatives import (
    DERIVATIVE_TOLERANCE,
    derivative_errors,
    directions,
    relative_error,
    second_order,
)
from attngrad.verify.reference import reference_attention
from attngrad.verify.rule import judge_run
from helpers import TENSOR_STRATEGIES, case


def _wrong_scale(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    # 1/d instead of 1/sqrt(d)
    return reference_attention(q, k, v, attn_mask, is_causal, 1 / q.shape[-1], enable_gqa)


class _NoRowSum(torch.autograd.Function):
    """Right forward, but dS = P * dP: the softmax backward without its row-sum term."""

    @staticmethod
    def forward(ctx, q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        scale = 1 / math.sqrt(q.shape[-1])
        ds = p * (dout @ v.transpose(-2, -1))
        return scale * ds @ k, scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def _no_row_sum(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    return _NoRowSum.apply(q, k, v)


def _nan_output(q, k, v, *args, **kwargs):
    out = reference_attention(q, k, v, *args, **kwargs)
    return out + torch.where(torch.arange(out.shape[-1]) == 0, float("nan"), 0.0).to(out.dtype)


def _crashes(q, k, v, *args, **kwargs):
    raise RuntimeError("kernel exploded")


# each case's expectation at seed 0, shared by every run on the case
_expected = functools.cache(expect_case)


def _run(strategy: str, c, **options) -> CaseResult:
    """`run_case` at seed 0, judged by the case's shared expectation."""
    return run_case(strategy, c, expected=_expected(c), **options)


CASE64 = case((2,), 2, 2, 9, 11, 8, 8)
CASE32 = case((2,), 2, 2, 9, 11, 8, 8, dtype=torch.float32)


@pytest.mark.parametrize(
    ("fn", "case"),
    [
        pytest.param(_wrong_scale, CASE64, id="wrong-scale-float64"),
        pytest.param(_wrong_scale, CASE32, id="wrong-scale-float32"),
        pytest.param(_no_row_sum, CASE64, id="no-row-sum-float64"),
        pytest.param(_no_row_sum, CASE32, id="no-row-sum-float32"),
        pytest.param(_nan_output, CASE32, id="nan-float32"),
        pytest.param(_crashes, CASE64, id="crash"),
    ],
)
def test_harness_fails_broken_implementations(fn, case):
    result = _run("broken", case, fn=fn)
    assert not result.passed
    assert result.as_dict()["passed"] is False


def test_harness_names_the_gradient_that_is_wrong():
    expected = _expected(CASE64)
    got = outputs_and_grads(_no_row_sum, CASE64, expected.inputs, torch.float64)
    bad = {v.name for v in judge_run(expected, got) if not v.passed}
    # the output and dV never go through the softmax backward; dq and dk do
    assert bad == {"dq", "dk"}
    result = _run("broken", CASE64, fn=_no_row_sum, gradcheck=False)
    assert not result.passed and "dq: error" in result.message and "dk: error" in result.message


def test_harness_gradcheck_verdict_is_false_for_a_wrong_backward():
    # float64 gradcheck is the harness's second judge; a backward without the
    # row-sum term must come back as gradcheck_passed=False, not as an exception
    # escaping run_case (regression: verify.py caught
    # `torch.autograd.gradcheck.GradcheckError`, an attribute of the gradcheck
    # *function*, so the except clause itself raised AttributeError)
    result = _run("broken", CASE64, fn=_no_row_sum, gradcheck=True)
    assert result.gradcheck_passed is False
    assert not result.passed


def test_harness_reports_a_crash_with_its_message():
    result = _run("broken", CASE64, fn=_crashes)
    assert "kernel exploded" in result.message


def test_harness_passes_the_reference_itself():
    # float64 reference against float64 reference: zero error, gradcheck passes
    result = _run("reference", CASE64, fn=reference_attention)
    assert result.passed and all(e == 0 for e in result.errors.values())


# --- higher derivatives: double backward, forward mode, gradgradcheck -----------------


def _scaled_output(fn, which: int, factor: float):
    """``fn`` with output ``which`` of its result multiplied by ``factor``."""

    def broken(*args, **kwargs):
        out = list(fn(*args, **kwargs))
        out[which] = out[which] * factor
        return tuple(out)

    return broken


def test_higher_derivatives_agree_on_every_strategy():
    # a float mask, GQA and Nq != Nk: every input of the second derivative is in play
    c = case((1,), 4, 2, 6, 9, 8, 8, "float")
    for strategy in TENSOR_STRATEGIES:
        result = _run(strategy, c, gradcheck=False)
        assert result.passed, (strategy, result.message)
        assert result.second_order_error < 1e-13 and result.jvp_error < 1e-13


def test_a_wrong_second_derivative_fails_the_case(monkeypatch):
    # SecondOrder's grad q off by one part in a million: first order and forward mode stay
    # right, so only the double-backward comparison can see it
    from attngrad.autograd import gradients

    monkeypatch.setattr(
        gradients, "second_order_of", _scaled_output(gradients.second_order_of, 2, 1 + 1e-6)
    )
    result = _run("flash", CASE64, gradcheck=False)
    assert result.rule_passed and result.jvp_error < DERIVATIVE_TOLERANCE
    assert result.second_order_error > 1e-8 and result.derivatives_passed is False
    assert not result.passed and "second_order: relative error" in result.message


def test_gradgradcheck_fails_a_wrong_second_derivative(monkeypatch):
    from attngrad.autograd import gradients

    monkeypatch.setattr(
        gradients, "second_order_of", _scaled_output(gradients.second_order_of, 2, 0.0)
    )
    result = _run("explicit", case((1,), 1, 1, 3, 4, 4), gradcheck=True)
    assert result.gradcheck_passed is True and result.gradgradcheck_passed is False
    assert not result.passed and "gradgradcheck failed" in result.message


def test_a_wrong_tangent_fails_the_case(monkeypatch):
    from attngrad.autograd import tangent

    monkeypatch.setattr(
        tangent, "output_tangent", _scaled_output(tangent.output_tangent, 0, 1 + 1e-6)
    )
    result = _run("explicit", CASE64, gradcheck=False)
    assert result.rule_passed and result.second_order_error < DERIVATIVE_TOLERANCE
    assert result.jvp_error > 1e-8 and not result.passed and "jvp: relative error" in result.message


def test_a_path_without_forward_mode_fails_with_the_error():
    # _NoRowSum has no jvp: the case fails and says why, instead of raising
    errors, messages = derivative_errors(_no_row_sum, CASE64, make_inputs(CASE64))
    assert errors["jvp"] == math.inf and any(m.startswith("jvp: ") for m in messages)
    # its backward is differentiable autograd, but without the row-sum term: wrong
    assert errors["second_order"] > 1e-3


def test_higher_derivatives_run_on_float64_only_and_can_be_left_out():
    assert _run("explicit", CASE32).second_order_error is None
    result = _run("explicit", CASE64, gradcheck=False, derivatives=False)
    assert (result.second_order_error, result.jvp_error, result.gradgradcheck_passed) == (
        None,
        None,
        None,
    )
    # gradgradcheck follows gradcheck; triton's (Triton's interpreter) is left out unless asked
    assert _run("explicit", CASE64, gradcheck=False).gradgradcheck_passed is None
    assert "triton" in SLOW_GRADGRADCHECK


def test_second_order_of_the_reference_against_itself_is_exact():
    inputs = make_inputs(CASE64)
    u = directions(inputs)
    h = second_order(reference_attention, CASE64, inputs, u)
    assert set(h) == {"q", "k", "v", "dout"} and h["dout"].shape == inputs["dout"].shape
    assert relative_error(h, h) == 0.0


def test_relative_error_is_floored_at_one_and_names_bad_arguments():
    # below 1 the error is absolute; above, relative to the largest magnitude of all names
    small = {"a": torch.tensor([0.0, 1e-3], dtype=torch.float64), "b": torch.tensor([0.5])}
    assert relative_error({**small, "a": small["a"] + 1e-9}, small) == pytest.approx(1e-9)
    ref = {"a": small["a"], "b": torch.tensor([4.0])}
    assert relative_error({"a": ref["a"] + 0.4, "b": ref["b"]}, ref) == pytest.approx(0.1)
    assert relative_error({"a": torch.tensor([math.nan, 0.0]), "b": ref["b"]}, ref) == math.inf
    with pytest.raises(ValueError, match=r"\['b'\]"):
        relative_error({"a": ref["a"]}, ref)
    with pytest.raises(ValueError, match="got\\['a'\\]: shape"):
        relative_error({"a": torch.zeros(3), "b": ref["b"]}, ref)


# --- attention's options beyond SDPA: the grid's cases and the mistakes they catch ---------

FEATURES = [c for c in default_cases()[64:] if c not in long_cases()]


def test_the_grid_covers_every_option_in_float64_and_float32_and_once_in_bfloat16():
    def has(dtype, **want):
        return any(c.dtype == dtype and _has(c, want) for c in FEATURES)

    tall = [c for c in FEATURES if c.shapes.seq_q > c.shapes.seq_k and c.align == "bottom-right"]
    wide = [c for c in FEATURES if c.shapes.seq_q < c.shapes.seq_k and c.align == "bottom-right"]
    empty_key = [c for c in FEATURES if c.segments is not None and 0 in c.segments[1]]
    for dtype in (torch.float64, torch.float32):
        assert has(dtype, dropout=0.2) and has(dtype, mask="float", softcap=1.5)
        assert has(dtype, sinks="token", mask="bool")  # make_inputs' dead row
        assert any(c.dtype == dtype and c.mask == "causal" for c in tall)
        assert any(c.dtype == dtype and c.mask == "causal" for c in empty_key)
    assert has(torch.float64, dropout=1.0) and has(torch.float64, sinks="head")
    assert any(c.mask == "causal" for c in wide) and any(c.window is not None for c in wide)
    assert [c.dtype for c in FEATURES if c.dtype not in (torch.float64, torch.float32)] == [
        torch.bfloat16
    ]
    # ids tell the cases apart, even as text inside a table row: none is inside another
    ids = [c.id for c in default_cases()]
    assert [a for a in ids for b in ids if a in b and a != b] == [] and len(set(ids)) == len(ids)


@pytest.mark.parametrize("c", FEATURES, ids=lambda c: c.id)
def test_every_option_case_is_judged_on_each_of_its_quantities(c):
    result = _run("explicit", c, gradcheck=False, derivatives=False)
    names = {"out", "dq", "dk", "dv", "lse"}
    names |= {"dmask"} if c.mask == "float" else set()
    names |= {"dsinks"} if c.sinks != "none" else set()
    assert set(result.ratios) == names
    assert result.passed, result.message


def _reference_with(change):
    """The reference with its keywords changed by ``change``: a mistake a strategy could make."""
    ref = as_attention(reference_attention)

    def fn(q, k, v, attn_mask=None, **kwargs):
        return ref(q, k, v, attn_mask, **change(kwargs))

    return fn


def _without(*names):
    return lambda kw: {n: x for n, x in kw.items() if n not in names}


def _with(**values):
    return lambda kw: {**kw, **values}


def _unscaled_dropout(q, k, v, attn_mask=None, dropout_p=0.0, generator=None, **kwargs):
    # the right mask, but kept entries not scaled by 1 / (1 - p)
    z = dropout_mask(q, k, dropout_p, generator)
    return reference_attention(q, k, v, attn_mask, dropout_mask=z, **kwargs)


def _feature(dtype, **fields):
    """The grid's first option case in ``dtype`` with these fields."""
    return next(c for c in FEATURES if c.dtype == dtype and _has(c, fields))


def _has(c, fields):
    return all(getattr(c, n) == w for n, w in fields.items())


MISTAKES = [
    ("softcap-ignored", _reference_with(_without("softcap")), dict(softcap=1.5)),
    ("top-left-not-bottom-right", _reference_with(_with(align="top-left")), dict(mask="causal", align="bottom-right")),
    ("window-top-left", _reference_with(_with(align="top-left")), dict(window=(8, 2))),
    ("segments-ignored", _reference_with(_without("cu_seqlens_q", "cu_seqlens_k")), dict(mask="causal", segments=((10, 7, 16), (20, 0, 27)))),
    ("other-dropout-mask", _reference_with(lambda kw: {**kw, "generator": torch.Generator().manual_seed(DROPOUT_SEED + 1)}), dict(dropout=0.2)),
    ("dropout-unscaled", _unscaled_dropout, dict(dropout=0.2)),
    ("sinks-as-zero-logits", _reference_with(lambda kw: {**kw, "sinks": kw["sinks"] * 0}), dict(sinks="token")),
    ("sink-logits-scaled", _reference_with(lambda kw: {**kw, "sinks": kw["sinks"] * 0.5}), dict(sinks="head")),
]  # fmt: skip


def _matching(fields):
    return [c for c in FEATURES if _has(c, fields)]


@pytest.mark.parametrize(
    ("fn", "c"),
    [pytest.param(f, c, id=f"{n}-{c.id}") for n, f, w in MISTAKES for c in _matching(w)],
)
def test_harness_fails_a_mistake_in_an_option(fn, c):
    result = _run("broken", c, fn=fn, gradcheck=False, derivatives=False)
    assert not result.rule_passed and "error" in result.message, result.message


def test_every_strategy_draws_the_mask_the_reference_applies():
    c = _feature(torch.float64, dropout=0.2)
    inputs = make_inputs(c)
    want = outputs_and_grads(as_attention(reference_attention), c, inputs, torch.float64)
    z = dropout_mask(inputs["q"], inputs["k"], 0.2, torch.Generator().manual_seed(DROPOUT_SEED))
    assert 0.7 < z.double().mean() < 0.9  # keeps about 1 - p
    for strategy in TENSOR_STRATEGIES:
        got = outputs_and_grads(strategy_fn(strategy), c, inputs, torch.float64)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-12, atol=1e-12, msg=name)


def test_gradcheck_of_a_dropout_case_draws_one_mask_per_call():
    # gradcheck calls the function again and again: a generator made once would move on and
    # draw another mask each time, so every call gets the case's keywords (and generator) anew
    c = _feature(torch.float64, dropout=0.2)
    result = _run("explicit", c, gradcheck=True, derivatives=False)
    assert result.gradcheck_passed is True
    assert c.kwargs["generator"] is not c.kwargs["generator"]
