"""`attngrad.learn.exercise`: the written exercise imports, grades as not implemented, and solved passes."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from attngrad.cli.exercise import add_exercise
from attngrad.cli.grade import add_grade
from attngrad.learn.exercise import SKELETON, locale_lang, write_exercise
from attngrad.learn.grade import grade

SOLUTION = """

def value_gradient(p, dout):
    return p.transpose(-2, -1) @ dout


def probability_gradient(dout, v):
    return torch.matmul(dout, v.mT)


def softmax_backward(p, dp):
    return p * (dp - (p * dp).sum(dim=-1, keepdim=True))


def query_key_gradients(ds, q, k, scale):
    return scale * ds @ k, scale * torch.einsum("bij,bid->bjd", ds, q)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_exercise(sub)
    add_grade(sub)
    return parser


@pytest.mark.parametrize(("lang", "marker"), [("zh", "练习"), ("en", "Exercise")])
def test_writes_both_languages(tmp_path: Path, lang: str, marker: str) -> None:
    paths = write_exercise(tmp_path / lang, lang=lang)
    assert [p.name for p in paths] == [SKELETON, "README.md"]
    readme = paths[1].read_text(encoding="utf-8")
    assert marker in readme and "attngrad grade attention_exercise.py" in readme
    assert "dV = Pᵀ·dO" in readme and "dK = scale·dSᵀ·Q" in readme
    tree = ast.parse(paths[0].read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert names == {
        "value_gradient",
        "probability_gradient",
        "softmax_backward",
        "query_key_gradients",
        "CustomAttention",
    }


def test_refuses_to_overwrite_unless_forced(tmp_path: Path, capsys) -> None:
    write_exercise(tmp_path)
    with pytest.raises(FileExistsError, match=r"attention_exercise\.py.*--force"):
        write_exercise(tmp_path, lang="en")
    parser = _parser()
    args = parser.parse_args(["exercise", str(tmp_path), "--lang", "en"])
    assert args.run(args) == 1
    assert "--force" in capsys.readouterr().err
    args = parser.parse_args(["exercise", str(tmp_path), "--lang", "en", "--force"])
    assert args.run(args) == 0
    assert "Exercise" in (tmp_path / "README.md").read_text(encoding="utf-8")


def test_unknown_language(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lang='fr'.*'en', 'zh'"):
        write_exercise(tmp_path, lang="fr")


@pytest.mark.parametrize(
    ("environ", "lang"),
    [
        ({}, "en"),  # no locale at all: a container, CI
        ({"LANG": "C.UTF-8"}, "en"),
        ({"LANG": "de_DE.UTF-8"}, "en"),
        ({"LANG": "zh_CN.UTF-8"}, "zh"),
        ({"LANG": "zh_TW.UTF-8"}, "zh"),
        ({"LANG": "zh_CN.UTF-8", "LC_ALL": "C"}, "en"),  # LC_ALL wins, as gettext reads it
        ({"LANG": "en_US.UTF-8", "LC_MESSAGES": "zh_CN.UTF-8"}, "zh"),
        ({"LANG": "en_US.UTF-8", "LANGUAGE": "zh_CN:en"}, "zh"),
        ({"LANG": "zh_CN.UTF-8", "LC_ALL": ""}, "zh"),  # set but empty: not a choice
    ],
)
def test_the_default_language_follows_the_locale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], lang: str
) -> None:
    for name in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert locale_lang() == lang
    args = _parser().parse_args(["exercise", str(tmp_path)])
    assert args.run(args) == 0
    source = (tmp_path / SKELETON).read_text(encoding="utf-8")
    chinese = "请由 p 和 dout 计算 dV" in source
    assert chinese == (lang == "zh") and ("compute dV from p and dout" in source) == (lang == "en")


def test_skeleton_grades_as_not_implemented(tmp_path: Path) -> None:
    (path, _) = write_exercise(tmp_path)
    report = grade(path, timeout=20)
    assert not report.passed
    assert [s.diagnosis for s in report.stages] == ["not-implemented"] * 5
    assert "TODO 1" in report.stages[0].message


def test_solved_skeleton_passes(tmp_path: Path, capsys) -> None:
    (path, _) = write_exercise(tmp_path, lang="en")
    path.write_text(path.read_text(encoding="utf-8") + SOLUTION, encoding="utf-8")
    parser = _parser()
    args = parser.parse_args(["grade", str(path), "--timeout", "20"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "all stages pass" in out and "FAIL" not in out
