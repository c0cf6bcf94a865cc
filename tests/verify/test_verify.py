"""`attngrad verify`: any SDPA-signature function judged by the conformance harness.

Good functions pass (SDPA, every tensor-op strategy: triton runs in Triton's
interpreter here, too slow for the grid, and tests/strategies/test_triton.py covers it); each
planted broken kernel fails with the right name, and one that refuses a feature
is reported unsupported, not failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import attngrad
from attngrad.cli.verify import add_verify, verify_table
from attngrad.verify import verify as external
from attngrad.verify.cases import long_cases
from attngrad.verify.check import expect_case
from attngrad.verify.verify import load, quick_cases, verify
from helpers import TENSOR_STRATEGIES

QUICK = quick_cases()
SPEC = "torch.nn.functional:scaled_dot_product_attention"


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    if is_causal:  # the flash-attn convention, not SDPA's top-left one
        nq, nk = q.shape[-2], k.shape[-2]
        attn_mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return _sdpa(q, k, v, attn_mask, dropout_p, False, scale, enable_gqa)


class _Scale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _dk_without_scale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    # dK = dS^T Q without the softmax scale: 1/scale = sqrt(d) too large
    k = _Scale.apply(k, math.sqrt(q.shape[-1]))
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _writes_input(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    q.data.mul_(0.5)  # "scratch space": the caller's q is halved
    return out


def _nan_dead_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # softmax of all -inf: 0 / 0
        dead = ~attn_mask.any(-1, keepdim=True)
        out = torch.where(dead, float("nan"), out)
    return out


class _RepeatFirstHead(torch.autograd.Function):
    """K/V repeated for each query head of a group; backward keeps only the group's first."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.repeat_interleave(groups, dim=-3)

    @staticmethod
    def backward(ctx, g):
        return g.unflatten(-3, (-1, ctx.groups))[..., 0, :, :].contiguous(), None


def _gqa_one_head(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = _RepeatFirstHead.apply(k, groups), _RepeatFirstHead.apply(v, groups)
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, False)


def _no_float_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise NotImplementedError("float masks are not supported")
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _failed(result):
    return [c for c in result.cases if c.passed is False]


# each grid case's expectation at seed 0, shared by the functions that pass the full grid
# (only those: a broken function may write into the inputs it is handed)
_expected = functools.cache(expect_case)


def test_sdpa_passes_the_full_grid():
    result = verify(load(SPEC), expected=_expected)
    assert result.passed, verify_table(result)
    assert len(result.cases) == len(external.sdpa_cases()) == 64 + len(long_cases())
    assert all(c.passed for c in result.cases) and not result.unsupported
    assert all(c.passed for c in result.checks)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_strategies_pass(strategy):
    result = verify(functools.partial(attngrad.attention, strategy=strategy), expected=_expected)
    assert result.passed, verify_table(result)


def test_bottom_right_causal_fails_causal_cases_with_nq_ne_nk():
    result = verify(_bottom_right, cases=QUICK)
    assert not result.passed
    failed = _failed(result)
    assert failed and all({"causal", "nq!=nk"} <= set(c.features) for c in failed)
    causal_wide = [c for c in result.cases if {"causal", "nq!=nk"} <= set(c.features)]
    assert all(c.passed is False for c in causal_wide)
    assert all("[" in c.message and "causal" in c.message for c in failed)


def test_dk_without_its_scale_fails_on_dk():
    result = verify(_dk_without_scale, cases=QUICK)
    assert not result.passed
    assert all(c.passed is False for c in result.cases)
    for c in result.cases:
        assert "dk: error" in c.message and "dq:" not in c.message and "dv:" not in c.message
        assert c.errors["dk"] > c.bounds["dk"]
    gradcheck = next(k for k in result.checks if k.name.startswith("gradcheck"))
    assert gradcheck.passed is False


def _bumps_version(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    with torch.no_grad():
        q.mul_(1.0)  # same values, but an in-place op: autograd's saved q would be stale
    return out


@pytest.mark.parametrize("fn", [_writes_input, _bumps_version], ids=["values", "version"])
def test_writing_into_an_input_fails_the_no_modification_check(fn):
    result = verify(fn, cases=QUICK)
    assert not result.passed
    check = next(k for k in result.checks if k.name.startswith("no input modified"))
    assert check.passed is False and "q modified in place" in check.message, verify_table(result)
    assert "without grad: q modified" in check.message


def test_nan_on_dead_rows_fails_the_dead_row_cases():
    result = verify(_nan_dead_rows, cases=QUICK)
    failed = _failed(result)
    dead = [c for c in result.cases if "dead rows" in c.features]
    assert dead and failed == dead
    assert all("out: NaN" in c.message and "dead rows" in c.message for c in failed)
    assert all(c.errors["out"] != c.errors["out"] for c in failed)  # NaN


def test_gqa_gradients_from_one_head_fail_dk_dv_on_gqa_cases():
    result = verify(_gqa_one_head, cases=QUICK)
    failed = _failed(result)
    gqa = [c for c in result.cases if "gqa" in c.features]
    assert gqa and failed == gqa
    for c in failed:
        assert "dk: error" in c.message and "dv: error" in c.message and "dq:" not in c.message


def test_refused_feature_is_unsupported_not_failed():
    result = verify(_no_float_mask, cases=QUICK)
    assert result.passed, verify_table(result)
    assert set(result.unsupported) == {"float mask", "float mask gradient"}
    assert "NotImplementedError" in result.unsupported["float mask"]
    floats = [c for c in result.cases if "float mask" in c.features]
    assert floats and all(c.passed is None for c in floats)
    assert all(c.passed for c in result.cases if "float mask" not in c.features)
    probe = next(k for k in result.checks if k.name == "feature float mask")
    assert probe.passed is None and "unsupported" in probe.message


def test_a_function_that_runs_nothing_fails():
    def crash(q, k, v, *args, **kwargs):
        raise NotImplementedError("nothing works")

    result = verify(crash, cases=QUICK[:2])
    assert not result.passed
    assert set(result.unsupported) == set(external.FEATURES)


def test_a_crash_on_a_probe_is_a_failure_not_a_refusal():
    def gqa_index_error(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # fmt: skip
        if q.shape[-3] != k.shape[-3]:
            raise IndexError("head index out of range")
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    result = verify(gqa_index_error, cases=QUICK)
    assert not result.passed and "gqa" not in result.unsupported
    probe = next(k for k in result.checks if k.name == "feature gqa")
    assert probe.passed is False and "IndexError" in probe.message
    assert all(c.passed is False and "IndexError" in c.message for c in _failed(result))


def test_load_module_and_file(tmp_path):
    assert load(SPEC) is F.scaled_dot_product_attention
    path = tmp_path / "kernel.py"
    path.write_text("def attn(q, k, v, *a, **kw):\n    return q\n")
    assert load(f"{path}:attn").__name__ == "attn"
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        load("torch.nn.functional.scaled_dot_product_attention")
    with pytest.raises(ImportError, match="no_such_module"):
        load("no_such_module:f")
    with pytest.raises(ImportError, match="no attribute 'nope'"):
        load("torch.nn.functional:nope")
    with pytest.raises(ImportError, match="no file"):
        load(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(ValueError, match="not a function"):
        load("math:pi")


def _main(argv):
    parser = argparse.ArgumentParser(prog="attngrad")
    add_verify(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_passes_sdpa_and_writes_json(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert _main(["verify", SPEC, "--json", str(out), "--seed", "1"]) == 0
    payload = json.loads(out.read_text())
    assert payload["passed"] is True and payload["unsupported"] == {}
    assert len(payload["cases"]) == len(external.sdpa_cases())
    first = payload["cases"][0]
    assert set(first) >= {"id", "features", "passed", "errors", "bounds", "message"}
    assert {c["name"].split(" ")[0] for c in payload["checks"]} >= {
        "gradcheck",
        "determinism",
        "no",
    }
    text = capsys.readouterr().out
    assert f"PASSED: {len(external.sdpa_cases())} cases pass" in text


def test_cli_fails_a_broken_kernel_and_refuses_a_bad_spec(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(
        "import torch.nn.functional as F\n"
        "def attn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, "
        "enable_gqa=False):\n"
        "    return F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal, "
        "scale=1.0 / q.shape[-1], enable_gqa=enable_gqa)\n"
    )
    out = tmp_path / "broken.json"
    assert _main(["verify", f"{path}:attn", "--json", str(out), "--no-gradcheck"]) == 1
    payload = json.loads(out.read_text())
    assert payload["passed"] is False
    assert any("out: error" in c["message"] for c in payload["cases"])
    assert _main(["verify", "not-a-spec"]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err
