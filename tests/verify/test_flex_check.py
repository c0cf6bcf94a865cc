"""FlexAttention in the conformance harness: the dense reference, the score function's rounding
analysis, the flex cases of `attngrad check` and `attngrad verify --flex`.

The reference is checked against torch's own eager flex_attention (forward: torch has no CPU
backward) and against the BlockMask's block semantics where they differ from its mask_mod;
every flex case passes on the strategies that run it and is refused by those whose kernels
cannot; planted bugs (dtheta 1% off in float32 and 5% in 16 bits, a score function's slope
forgotten in backward, a BlockMask's partial blocks kept whole, NaN on a dead row) fail.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import attngrad
from attngrad.cli import app as cli
from attngrad.cli import check as check_command
from attngrad.cli.verify import verify_table
from attngrad.verify.cases import Case, flex_cases, make_inputs, outputs_and_grads
from attngrad.verify.check import expect_case, flex_strategy_fn, refusal, run_case
from attngrad.verify.flex_cases import BLOCK, SOFTCAP, block_mask, scenario
from attngrad.verify.flex_reference import (
    block_keep,
    plain_flex_attention,
    reference_flex_attention,
    reference_flex_lse,
)
from attngrad.verify.rule import judge_run
from attngrad.verify.score_rounding import LIBRARY_ROUNDINGS, analyse
from attngrad.verify.verify import flex_signature, quick_flex_cases, verify
from helpers import TENSOR_STRATEGIES

FLEX = flex_cases()
THETA = [c for c in FLEX if scenario(c.flex).theta is not None]  # ALiBi, the bucket table
BLOCKS = [c for c in FLEX if scenario(c.flex).mask is not None]
# each case's expectation at seed 0, shared by every run on it
_expected = functools.cache(expect_case)


def _call_args(c: Case, dtype: torch.dtype = torch.float64):
    """q, k, v, score_mod and block_mask of the case's inputs, in ``dtype``."""
    inputs = make_inputs(c)
    q, k, v = (inputs[n].to(dtype) for n in ("q", "k", "v"))
    s = scenario(c.flex)
    theta = None if inputs.get("theta") is None else inputs["theta"].to(dtype)
    score_mod = None if s.score is None else s.score(theta)
    return q, k, v, score_mod, block_mask(s.name, c.shapes.seq_q, c.shapes.seq_k)


# --- the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("c", [c for c in FLEX if c.dtype == torch.float64], ids=lambda c: c.id)
def test_reference_matches_torchs_eager_flex_attention(c):
    q, k, v, score_mod, blocks = _call_args(c)
    out, lse = flex_attention(q, k, v, score_mod, blocks, enable_gqa=c.gqa, return_lse=True)
    ref = reference_flex_attention(q, k, v, score_mod, blocks, enable_gqa=c.gqa)
    torch.testing.assert_close(ref, out, rtol=1e-12, atol=1e-12)
    ref_lse = reference_flex_lse(q, k, score_mod, blocks, enable_gqa=c.gqa)
    torch.testing.assert_close(ref_lse, lse, rtol=1e-12, atol=1e-12)


def test_full_blocks_skip_the_mask_mod_and_empty_blocks_drop_everything():
    # a BlockMask whose lists disagree with its mask_mod: block (0, 0) listed full although
    # mask_mod keeps only the diagonal, block (1, 1) partial, block (1, 0) in neither list
    n = 2 * BLOCK
    kv_num = torch.tensor([[[0, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 0], [0, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
        mask_mod=lambda b, h, i, j: i == j, seq_lengths=(n, n),
    )  # fmt: skip
    keep = block_keep(bm, 1, 1, n, n)[0, 0]
    eye = torch.eye(BLOCK, dtype=torch.bool)
    assert bool(keep[:BLOCK, :BLOCK].all())  # full: kept whole, mask_mod not asked
    assert torch.equal(keep[BLOCK:, BLOCK:], eye)  # partial: mask_mod
    assert not bool(keep[BLOCK:, :BLOCK].any()) and not bool(keep[:BLOCK, BLOCK:].any())


def test_rows_that_attend_nothing_give_zeros_and_zero_gradients():
    c = next(c for c in FLEX if c.flex == "empty-rows" and c.dtype == torch.float64)
    q, k, v, score_mod, blocks = _call_args(c)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = reference_flex_attention(q, k, v, score_mod, blocks)
    out.sum().backward()
    dead = [5, *range(BLOCK, 2 * BLOCK)]
    assert not bool(out[:, :, dead].any()) and not bool(q.grad[:, :, dead].any())
    assert all(bool(t.isfinite().all()) for t in (out, q.grad, k.grad, v.grad))
    lse = reference_flex_lse(q, k, score_mod, blocks)
    assert bool((lse[:, :, dead] == float("-inf")).all())


def test_the_plain_run_rounds_a_wider_score_back_to_the_dtype():
    # float32 ALiBi slopes beside bfloat16 q, k, v: the scores come back in bfloat16
    c = next(c for c in THETA if c.dtype == torch.bfloat16)
    assert c.theta_dtype == torch.float32 and "[theta:float32]" in c.id
    q, k, v, _, blocks = _call_args(c, torch.bfloat16)
    slopes = make_inputs(c)["theta"].float()
    out = plain_flex_attention(q, k, v, scenario("alibi").score(slopes), blocks)
    assert out.dtype == torch.bfloat16


# --- the score function's rounding analysis -----------------------------------------------


def test_analysis_of_the_soft_cap_is_its_closed_form():
    x = torch.randn(1, 2, 5, 7, dtype=torch.float64) * 3
    a = analyse(scenario("softcap").score, x, None)
    t = torch.tanh(x / SOFTCAP)
    torch.testing.assert_close(a.value, SOFTCAP * t)
    torch.testing.assert_close(a.slope, 1 - t**2)
    torch.testing.assert_close(a.curvature, (2 * t * (1 - t**2) / SOFTCAP).abs())
    # x / c and c * tanh round once each, tanh (a library function) up to LIBRARY_ROUNDINGS:
    # |dT/dv| |v| is c (1 - t^2) |x / c|, LIBRARY_ROUNDINGS c |t| and |c t|
    expected = (1 - t**2) * x.abs() + (LIBRARY_ROUNDINGS + 1) * (SOFTCAP * t).abs()
    torch.testing.assert_close(a.rounding, expected)
    assert a.jacobian is None


def test_analysis_of_alibi_gives_its_jacobian():
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    a = analyse(scenario("alibi").score, x, slopes)
    i, j = torch.arange(4).view(4, 1), torch.arange(6).view(1, 6)
    assert torch.equal(a.slope, torch.ones_like(x)) and not bool(a.curvature.any())
    # J[b, h, i, j, h'] = (j - i) where h' = h, else 0; dJ/dX = 0
    expected = torch.zeros(2, 3, 4, 6, 3, dtype=torch.float64)
    for h in range(3):
        expected[:, h, :, :, h] = (j - i).double()
    assert a.jacobian is not None and torch.equal(a.jacobian, expected)
    assert a.jacobian_slope is not None and not bool(a.jacobian_slope.any())
    # one product and one sum, each rounding once: |slope (j - i)| + |T|
    torch.testing.assert_close(
        a.rounding, (slopes.view(1, 3, 1, 1) * (j - i)).abs() + a.value.abs()
    )


# --- attngrad check's flex cases ---------------------------------------------------------


def test_flex_cases_cover_every_scenario_in_every_dtype():
    dtypes = {torch.float64, torch.float32, torch.bfloat16, torch.float16}
    names = {"alibi", "softcap", "relative", "document", "sliding", "prefix", "empty-rows"}
    assert {(c.flex, c.dtype) for c in FLEX} == {(n, d) for n in names for d in dtypes}
    ids = [c.id for c in FLEX]
    assert len(set(ids)) == len(ids) and not [a for a in ids for b in ids if a in b and a != b]


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash"])
def test_every_flex_case_passes_on_the_tensor_op_strategies(strategy):
    for c in FLEX:
        gradcheck = c.dtype == torch.float64 and strategy == "flash"  # one strategy's suffices
        result = run_case(strategy, c, expected=_expected(c), gradcheck=gradcheck)
        assert result.passed, (c.id, result.message)
        assert ("dtheta" in result.ratios) == (c in THETA)


def test_fused_runs_every_flex_case_and_triton_refuses_score_functions():
    fused = "fused" in TENSOR_STRATEGIES
    for c in (c for c in FLEX if c.dtype == torch.float32):
        inputs = make_inputs(c)
        # fused runs score functions as programs and reads a BlockMask as its band
        assert not fused or refusal("fused", c, inputs) is None, c.id
        reason = refusal("triton", c, inputs)
        if scenario(c.flex).score is not None:
            assert reason is not None and "score_mod" in reason, (c.id, reason)
        else:
            assert reason is None or "BlockMask" in reason, (c.id, reason)
    c = next(c for c in FLEX if c.flex == "softcap" and c.dtype == torch.float32)
    result = run_case("triton", c, expected=_expected(c))
    assert result.refused and "score_mod" in result.refused
    assert not result.passed and not result.failed and result.as_dict()["passed"] is None


def test_check_command_shows_refused_cases_and_exits_0(monkeypatch, capsys, tmp_path):
    grid = [c for c in FLEX if c.dtype == torch.float32 and c.flex in ("alibi", "softcap")]
    monkeypatch.setattr(check_command, "default_cases", lambda: [])
    monkeypatch.setattr(check_command, "flex_cases", lambda: grid)
    path = tmp_path / "check.json"
    argv = ["check", "--strategy", "triton", "--strategy", "flash", "--no-gradcheck"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main([*argv, "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "triton: 0 passed, 0 failed, 2 refused" in lines
    assert "flash: 2 passed, 0 failed" in lines
    reasons = [line for line in lines if line.startswith("  refused: ")]
    assert len(reasons) == 1 and "score_mod" in reasons[0]  # each reason once
    rows = [line for line in lines if line.startswith("triton ")]
    assert len(rows) == 2 and all(" refused " in row for row in rows)
    report = json.loads(path.read_text())
    assert report["passed"] is True
    assert [r["passed"] for r in report["results"]] == [None, None, True, True]


# --- the rule's power on flex cases ------------------------------------------------------


def _judged(c: Case, got) -> dict[str, float]:
    return {v.name: v.ratio for v in judge_run(_expected(c), got)}


@pytest.mark.parametrize("c", [c for c in THETA if c.dtype != torch.float64], ids=lambda c: c.id)
def test_dtheta_off_by_one_percent_in_float32_and_five_in_16_bits_fails(c):
    got = outputs_and_grads(flex_strategy_fn("flash"), c, _expected(c).inputs, c.dtype)
    assert max(_judged(c, got).values()) <= 1
    off = 1.01 if c.dtype == torch.float32 else 1.05
    assert _judged(c, {**got, "dtheta": got["dtheta"] * off})["dtheta"] > 1


def _slope_forgotten(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """The score function's value in forward, but its derivative taken as 1 (and no dtheta)."""
    if score_mod is not None:
        inner = score_mod

        def score_mod(s, b, h, i, j):
            return s + (inner(s, b, h, i, j) - s).detach()

    return attngrad.flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa)


def _partial_blocks_whole(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """The BlockMask's lists, but its partial blocks kept whole (mask_mod never asked)."""
    if block_mask is not None:
        block_mask = BlockMask.from_kv_blocks(
            block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
            mask_mod=lambda b, h, i, j: i >= 0, seq_lengths=block_mask.seq_lengths,
        )  # fmt: skip
    return attngrad.flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa)


def _nan_on_dead_rows(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """Dead rows as 0 / 0: NaN where a row attends nothing."""
    out, lse = attngrad.flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, True)
    return torch.where(lse.unsqueeze(-1) == float("-inf"), float("nan"), out)


@pytest.mark.parametrize(
    ("fn", "flex"),
    [
        pytest.param(_slope_forgotten, "softcap", id="slope-forgotten-softcap"),
        pytest.param(_slope_forgotten, "relative", id="slope-forgotten-relative"),
        pytest.param(_partial_blocks_whole, "document", id="partial-whole-document"),
        pytest.param(_partial_blocks_whole, "sliding", id="partial-whole-sliding"),
        pytest.param(_nan_on_dead_rows, "empty-rows", id="nan-dead-rows"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_planted_flex_bugs_fail(fn, flex, dtype):
    c = next(c for c in FLEX if c.flex == flex and c.dtype == dtype)
    result = run_case("planted", c, expected=_expected(c), fn=fn)
    assert result.failed, result.ratios


# --- attngrad verify --flex ----------------------------------------------------------------


def test_flex_signature_is_found_by_its_parameters():
    assert flex_signature(flex_attention) and flex_signature(attngrad.flex_attention)
    assert not flex_signature(torch.nn.functional.scaled_dot_product_attention)
    assert not flex_signature(len)


def test_verify_passes_attngrad_flex_attention():
    cases = quick_flex_cases()
    result = verify(
        attngrad.flex_attention, cases=cases, flex=True, gradcheck=False, expected=_expected
    )
    assert result.passed and not result.unsupported, verify_table(result)
    assert all(c.passed for c in result.cases) and all(k.passed for k in result.checks)


def test_verify_judges_torchs_flex_attention_forward_only():
    # torch's flex_attention has no CPU backward: its output is judged, its backward reported
    cases = [c for c in quick_flex_cases() if c.flex in ("alibi", "empty-rows")]
    result = verify(flex_attention, cases=cases, flex=True, expected=_expected)
    table = verify_table(result)
    assert result.passed, table
    assert set(result.unsupported) == {"backward", "captured gradient"}
    assert "does not support backward" in result.unsupported["backward"]
    assert all(c.passed and set(c.errors) == {"out"} for c in result.cases)
    assert all("forward only (no backward)" in c.message for c in result.cases)
    assert {k.name: k.passed for k in result.checks}["gradcheck (float64, fast mode)"] is None
    assert "determinism (5 forward runs, bit for bit)" in table


def test_verify_fails_a_kernel_that_forgets_the_score_functions_slope():
    # softcap: dq and dk without the cap's slope; the table: a zero dtheta; documents: no
    # score function, nothing to forget
    cases = [c for c in quick_flex_cases() if c.flex in ("softcap", "relative", "document")]
    result = verify(_slope_forgotten, cases=cases, flex=True, gradcheck=False, expected=_expected)
    assert not result.passed and not result.unsupported
    assert {c.id: c.passed for c in result.cases} == {c.id: c.flex == "document" for c in cases}


def test_verify_command_takes_a_flex_kernel_from_a_file(tmp_path, capsys):
    kernel = tmp_path / "kernel.py"
    kernel.write_text(
        "import attngrad\n"
        "def attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False):\n"
        "    return attngrad.flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa)\n"
    )
    report = tmp_path / "verify.json"
    quick = [c.id for c in quick_flex_cases()]
    argv = ["verify", f"{kernel}:attention", "--no-gradcheck", "--json", str(report)]
    # the full flex grid is the command's; the quick one keeps this test short
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("attngrad.verify.verify.flex_cases", lambda: [c for c in FLEX if c.id in quick])
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(FlexAttention's signature)" in out and "PASSED" in out
    payload = json.loads(report.read_text())
    assert payload["flex"] is True and len(payload["cases"]) == len(quick)
