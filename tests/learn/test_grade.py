"""`attngrad.learn.grade`: planted mistakes are named, hangs and crashes are reported, JSON format.

Each planted file carries one mistake per TODO function, so one child process
grades four mistakes; styles vary (``@``, torch.matmul, torch.einsum, .mT,
.transpose(-2, -1)).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from attngrad.cli.grade import add_grade, grade_table
from attngrad.core import ops
from attngrad.learn.engine import grade_attention, grade_function
from attngrad.learn.exercise import skeleton
from attngrad.learn.grade import grade
from attngrad.learn.mistakes import MISTAKES


def _planted(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(skeleton("en") + "\n\n" + textwrap.dedent(body), encoding="utf-8")
    return path


# ------------------------------------------------- the engine in-process (no child)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: f"{m.id}:{m.explanation[:20]}")
def test_each_catalogued_mistake_is_named(mistake) -> None:
    result = grade_function(mistake.stage, mistake.fn)
    assert not result["passed"]
    assert result["diagnosis"] == mistake.id


@pytest.mark.parametrize(
    ("stage", "fn"),
    [
        ("value_gradient", ops.value_gradient),
        ("probability_gradient", ops.probability_gradient),
        ("softmax_backward", ops.softmax_backward),
        ("query_key_gradients", ops.query_key_gradients),
    ],
)
def test_reference_passes_in_process(stage, fn) -> None:
    result = grade_function(stage, fn)
    assert result["passed"], result


def test_attention_stage_in_process() -> None:
    from attngrad.learn.chapter import CustomAttention

    assert grade_attention(CustomAttention, [])["passed"]


# ------------------------------------------- the chapter's own solution and its contract

# the course chapter's reference solution (its "参考代码"), messages in English: the grader
# asks for the input checks its forward makes and for nothing else
CHAPTER_SOLUTION = """
import math

import torch
import torch.nn.functional as F


def value_gradient(p, dout):
    return torch.matmul(p.transpose(-2, -1), dout)


def probability_gradient(dout, v):
    return torch.matmul(dout, v.transpose(-2, -1))


def softmax_backward(p, dp):
    weighted_sum = (dp * p).sum(dim=-1, keepdim=True)
    return p * (dp - weighted_sum)


def query_key_gradients(ds, q, k, scale):
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk


class CustomAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:  # check: ndim
            raise ValueError("q, k, v must be [batch, seq_len, head_dim] tensors")
        if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:  # check: lengths
            raise ValueError("q, k, v must share batch and seq_len")
        if q.size(-1) != k.size(-1) or v.size(-1) != q.size(-1):  # check: head_dim
            raise ValueError("q, k, v must share head_dim")
        if q.device != k.device or k.device != v.device:  # check: device
            raise ValueError("q, k, v must be on one device")
        if q.dtype != k.dtype or k.dtype != v.dtype:  # check: dtype
            raise TypeError("q, k, v must share a dtype")
        scale = 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        p = F.softmax(scores, dim=-1)
        out = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        if dout.shape != q.shape:
            raise ValueError("dout must have the output's shape")
        dv = value_gradient(p, dout)
        dp = probability_gradient(dout, v)
        ds = softmax_backward(p, dp)
        dq, dk = query_key_gradients(ds, q, k, ctx.scale)
        return dq, dk, dv
"""
# each input check of the chapter's forward, with the grader's bad call that it refuses
CHAPTER_CHECKS = {
    "ndim": "a 2-D input",
    "lengths": "sequence lengths differ",
    "head_dim": "head dims differ",
    "device": "devices differ",
    "dtype": "dtypes differ",
}


def _chapter_module(tmp_path: Path, drop: str | None = None) -> ModuleType:
    """The chapter's solution as a module, without the input check ``drop`` (if/raise)."""
    lines = CHAPTER_SOLUTION.splitlines()
    if drop is not None:
        at = next(i for i, line in enumerate(lines) if line.endswith(f"# check: {drop}"))
        del lines[at : at + 2]
    path = tmp_path / f"chapter_without_{drop}.py"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chapter_solution_passes(tmp_path: Path) -> None:
    path = tmp_path / "chapter_solution.py"
    path.write_text(CHAPTER_SOLUTION, encoding="utf-8")
    report = grade(path, timeout=20)
    assert report.passed, grade_table(report)


def test_torch_refusing_integer_inputs_is_no_contract_violation(tmp_path: Path) -> None:
    # the chapter checks no dtype but sameness: its integer inputs reach torch.matmul of the
    # float P and the integer v, which raises RuntimeError; the grader must not ask for more
    attention = _chapter_module(tmp_path).CustomAttention
    with pytest.raises(RuntimeError):
        attention.apply(*(torch.ones(2, 3, 4, dtype=torch.long),) * 3)
    result = grade_attention(attention, [])
    assert result["passed"], result


@pytest.mark.parametrize(("drop", "bad_call"), CHAPTER_CHECKS.items())
def test_dropping_a_chapter_check_is_caught(tmp_path: Path, drop: str, bad_call: str) -> None:
    result = grade_attention(_chapter_module(tmp_path, drop).CustomAttention, [])
    assert not result["passed"]
    assert result["diagnosis"] == "contract-violated", result
    assert result["message"].startswith(bad_call + ":"), result


# ------------------------------------------------------------ planted files, graded

PLANTED = {
    "at_style": (
        """
        def value_gradient(p, dout):
            return p @ dout

        def probability_gradient(dout, v):
            return dout @ v

        def softmax_backward(p, dp):
            return p * dp

        def query_key_gradients(ds, q, k, scale):
            return ds @ k, ds.transpose(-2, -1) @ q
        """,
        [
            "value-missing-transpose",
            "probability-missing-transpose",
            "softmax-no-rowsum",
            "qk-missing-scale",
        ],
    ),
    "matmul_style": (
        """
        def value_gradient(p, dout):
            return torch.matmul(p, dout)

        def probability_gradient(dout, v):
            return torch.matmul(dout, v)

        def softmax_backward(p, dp):
            w = torch.sum(torch.mul(p, dp), dim=1, keepdim=True)
            return torch.mul(p, dp - w)

        def query_key_gradients(ds, q, k, scale):
            dq = torch.matmul(ds, k) * scale * scale
            dk = torch.matmul(ds.transpose(-2, -1), q) * scale * scale
            return dq, dk
        """,
        [
            "value-missing-transpose",
            "probability-missing-transpose",
            "softmax-rowsum-wrong-dim",
            "qk-wrong-scale",
        ],
    ),
    "einsum_style": (
        """
        def value_gradient(p, dout):
            return torch.einsum("bij,bjd->bid", p, dout)

        def probability_gradient(dout, v):
            return torch.einsum("bid,bdj->bij", dout, v)

        def softmax_backward(p, dp):
            w = torch.einsum("bij,bij->bi", p, dp)
            return p * (dp - w)

        def query_key_gradients(ds, q, k, scale):
            dq = scale * torch.einsum("bij,bjd->bid", ds, k)
            dk = scale * torch.einsum("bij,bjd->bid", ds, q)
            return dq, dk
        """,
        [
            "value-missing-transpose",
            "probability-missing-transpose",
            "softmax-keepdim-lost",
            "key-missing-transpose",
        ],
    ),
    "mT_style": (
        """
        def value_gradient(p, dout):
            return dout.mT @ p

        def probability_gradient(dout, v):
            return v @ dout.mT

        def softmax_backward(p, dp):
            return dp - (p * dp).sum(-1, keepdim=True)

        def query_key_gradients(ds, q, k, scale):
            return scale * ds.mT @ q, scale * ds @ k
        """,
        [
            "value-swapped-operands",
            "probability-swapped-operands",
            "softmax-missing-p",
            "qk-swapped",
        ],
    ),
    "transpose_style": (
        """
        def value_gradient(p, dout):
            return dout

        def probability_gradient(dout, v):
            return dout @ v.transpose(-2, -1) / 0.0 * 0.0

        def softmax_backward(p, dp):
            return p * ((p * dp).sum(dim=-1, keepdim=True) - dp)

        def query_key_gradients(ds, q, k, scale):
            d = math.sqrt(q.size(-1))
            return ds @ k * d, ds.transpose(-2, -1) @ q * d
        """,
        ["shape-mismatch", "non-finite", "softmax-sign", "qk-wrong-scale"],
    ),
    "mixed_style": (
        """
        def value_gradient(p, dout):
            return torch.matmul(p.transpose(-2, -1), dout)

        def probability_gradient(dout, v):
            return torch.einsum("bid,bjd->bij", dout, v)

        def softmax_backward(p, dp):
            return p * (dp - dp.sum(dim=-1, keepdim=True))

        def query_key_gradients(ds, q, k, scale):
            return scale * (ds @ k), ds.mT @ q
        """,
        [None, None, "softmax-unweighted-rowsum", "qk-missing-scale"],
    ),
}
FUNCTIONS = ["value_gradient", "probability_gradient", "softmax_backward", "query_key_gradients"]


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_mistakes_are_diagnosed(tmp_path: Path, name: str) -> None:
    body, expected = PLANTED[name]
    report = grade(_planted(tmp_path, name, body), timeout=20)
    for stage, want in zip(FUNCTIONS, expected, strict=True):
        got = report.stage(stage)
        assert got.passed == (want is None), (stage, got)
        assert got.diagnosis == want, (stage, got)
        assert got.message
    attention = report.stage("CustomAttention")
    assert not attention.passed
    assert not report.passed


def test_endless_loop_is_reported_as_timeout(tmp_path: Path) -> None:
    path = _planted(
        tmp_path,
        "loops",
        """
        def value_gradient(p, dout):
            return p.mT @ dout

        def probability_gradient(dout, v):
            return dout @ v.mT

        def softmax_backward(p, dp):
            return p * (dp - (p * dp).sum(-1, keepdim=True))

        def query_key_gradients(ds, q, k, scale):
            while True:
                pass
        """,
    )
    report = grade(path, timeout=2)
    assert [s.passed for s in report.stages] == [True, True, True, False, False]
    assert report.stage("query_key_gradients").diagnosis == "timeout"
    assert report.stage("CustomAttention").diagnosis == "timeout"


def test_crash_at_import_fails_every_stage(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import torch\nraise RuntimeError('boom at import')\n", encoding="utf-8")
    report = grade(path, timeout=20)
    assert len(report.stages) == 5
    assert all(s.diagnosis == "crashed" and not s.passed for s in report.stages)
    assert "boom at import" in report.stages[0].message


def test_cli_json_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _planted(
        tmp_path,
        "json_case",
        """
        def value_gradient(p, dout):
            return p.mT @ dout

        def probability_gradient(dout, v):
            return dout @ v.mT

        def query_key_gradients(ds, q, k, scale):
            return scale * ds @ k, scale * ds.mT @ q

        def softmax_backward(p, dp):
            print("learner output must not confuse the grader")
            return p * dp
        """,
    )
    parser = argparse.ArgumentParser()
    add_grade(parser.add_subparsers())
    out = tmp_path / "result.json"
    args = parser.parse_args(["grade", str(path), "--json", str(out), "--timeout", "20"])
    assert args.run(args) == 1
    table = capsys.readouterr().out
    assert "softmax-no-rowsum" in table and "stage" in table
    data = json.loads(out.read_text(encoding="utf-8"))
    assert set(data) == {"passed", "stages"}
    assert data["passed"] is False
    assert [s["name"] for s in data["stages"]] == [*FUNCTIONS, "CustomAttention"]
    for s in data["stages"]:
        assert set(s) == {"name", "passed", "diagnosis", "message"}
        assert isinstance(s["message"], str)
    by_name = {s["name"]: s for s in data["stages"]}
    assert by_name["softmax_backward"] == {
        "name": "softmax_backward",
        "passed": False,
        "diagnosis": "softmax-no-rowsum",
        "message": by_name["softmax_backward"]["message"],
    }
    assert by_name["value_gradient"]["passed"] and by_name["value_gradient"]["diagnosis"] is None
    assert by_name["CustomAttention"]["diagnosis"] == "backward-wrong"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        grade(tmp_path / "nope.py")
