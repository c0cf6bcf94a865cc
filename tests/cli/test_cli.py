"""The ``attngrad`` command: check's exit codes, JSON report and table; the argparse
types; --version, every subcommand's description and ``python -m attngrad``.

The full grid runs once, end to end (`test_check_runs_the_full_grid_end_to_end`); the tests
of the command's plumbing run ``check`` on `SMALL_GRID`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import attngrad
from attngrad.cli import app as cli
from attngrad.cli import check as check_command
from attngrad.cli.args import measure_device, positive_float, positive_int
from attngrad.core.contract import Shapes
from attngrad.core.progress import duration
from attngrad.verify.cases import Case, default_cases, flex_cases
from attngrad.verify.check import SLOW_GRADGRADCHECK, CaseResult
from helpers import TENSOR_STRATEGIES


def _read(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# The grid of the plumbing tests: the full grid's one-key layout (B2x2-H2:1-N7x1, its
# smallest) in three dtypes: float64 for gradcheck's column, a float mask for dmask's.
SMALL_GRID = [
    c
    for c in default_cases()
    if c.shapes.seq_k == 1
    and (c.dtype, c.mask)
    in ((torch.float64, "none"), (torch.float32, "float"), (torch.bfloat16, "causal"))
]


@pytest.fixture
def small_grid(monkeypatch: pytest.MonkeyPatch) -> list[Case]:
    """``check`` runs `SMALL_GRID` in place of the full grid (and no flex case)."""
    monkeypatch.setattr(check_command, "default_cases", lambda: list(SMALL_GRID))
    monkeypatch.setattr(check_command, "flex_cases", lambda: [])
    return SMALL_GRID


def test_the_small_grid_is_three_cases_of_the_full_one():
    assert [(c.dtype, c.mask) for c in SMALL_GRID] == [
        (torch.float64, "none"),
        (torch.float32, "float"),
        (torch.bfloat16, "causal"),
    ]


# The full grid, end to end: ``attngrad check --strategy S --json PATH --csv PATH`` for every
# strategy, each its own test so that the two workers of `pytest -n 2` share them.  triton
# runs in Triton's interpreter, seconds a case (the other strategies take seconds for the
# grid): it runs the grid a case a test, the tests together the whole grid.  The flex cases
# come last; a strategy whose kernels cannot run one (fused and triton: a score function)
# reports it refused.
FULL_GRID_RUNS = [
    *(pytest.param(s, None, id=s) for s in TENSOR_STRATEGIES),
    *(pytest.param("triton", c, id=f"triton-{c.id}") for c in default_cases() + flex_cases()),
]


# What each case is judged against (the float64 reference, the plain run in the case's dtype
# and the bounds), computed once per worker and case: `check` shares it across the strategies
# of one run, these tests across their runs (each check runs one strategy).
_expected = functools.cache(check_command.expect_case)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "one_case"), FULL_GRID_RUNS)
def test_check_runs_the_full_grid_end_to_end(strategy, one_case, tmp_path, monkeypatch, capsys):
    cases = default_cases() + flex_cases() if one_case is None else [one_case]
    monkeypatch.setattr(check_command, "expect_case", _expected)
    if one_case is not None:
        monkeypatch.setattr(check_command, "default_cases", lambda: list(cases))
        monkeypatch.setattr(check_command, "flex_cases", lambda: [])
    path, csv_path = tmp_path / "check.json", tmp_path / "check.csv"
    argv = ["check", "--strategy", strategy, "--json", str(path), "--csv", str(csv_path)]
    assert cli.main(argv) == 0
    report = _read(path)
    assert report["passed"] is True
    assert report["strategies"] == [strategy]
    got = [(r["strategy"], r["case"]) for r in report["results"]]
    assert got == [(strategy, c.id) for c in cases]
    ran = [r for r in report["results"] if r["refused"] is None]
    failed = [r for r in ran if r["passed"] is not True]
    assert not failed, failed[:3]
    refused = [r for r in report["results"] if r["refused"] is not None]
    # only a flex case is refused, and only by triton, whose kernels run no score function
    assert all("flex:" in r["case"] and r["passed"] is None for r in refused)
    assert not refused or strategy == "triton"
    for r in ran:
        # float64 cases also ran gradcheck, the higher derivatives and (except on the
        # strategies whose gradgradcheck is slow) gradgradcheck; the others have no verdict
        float64 = r["dtype"] == "float64"
        gradgrad = float64 and strategy not in SLOW_GRADGRADCHECK
        assert r["gradcheck_passed"] is (True if float64 else None), r["case"]
        assert (r["second_order_error"] is not None) is float64, r["case"]
        assert r["gradgradcheck_passed"] is (True if gradgrad else None), r["case"]
        if float64 and strategy == "flash":
            assert r["second_order_error"] < 1e-13 and r["jvp_error"] < 1e-13

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["d2", "jvp", "gradgrad"]
    rows = [line for line in lines if line.startswith(f"{strategy} ")]
    assert len(rows) == len(cases)
    for c in cases:
        assert sum(c.id in row for row in rows) == 1, c.id
    counts = f"{strategy}: {len(ran)} passed, 0 failed"
    assert counts + (f", {len(refused)} refused" if refused else "") in lines
    assert f"wrote {csv_path}" in lines
    with csv_path.open(encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 1 + len(cases)


def test_check_without_a_strategy_runs_every_strategy(monkeypatch, tmp_path):
    # one case: triton's interpreter takes seconds a case
    one_case = SMALL_GRID[:1]
    monkeypatch.setattr(check_command, "default_cases", lambda: list(one_case))
    monkeypatch.setattr(check_command, "flex_cases", lambda: [])
    path = tmp_path / "check.json"
    assert cli.main(["check", "--no-gradcheck", "--json", str(path)]) == 0
    report = _read(path)
    assert report["passed"] is True
    assert report["strategies"] == list(attngrad.STRATEGIES)
    got = [(r["strategy"], r["case"]) for r in report["results"]]
    assert got == [(s, c.id) for s in attngrad.STRATEGIES for c in one_case]


def test_the_estimate_knows_every_strategy_and_weighs_flex_cases():
    plain, flex = Case(Shapes((2,), 2, 2, 33, 33, 16, 16), torch.float32), flex_cases()[0]
    for s in attngrad.STRATEGIES:
        one = check_command.estimate([s], [plain], gradcheck=False)
        assert 0 < one < check_command.estimate([s], [plain], gradcheck=True)
        assert check_command.estimate([s], [flex], gradcheck=False) > 2 * one
    both = check_command.estimate(["explicit", "fused"], [plain, plain], gradcheck=False)
    assert both == pytest.approx(
        2 * sum(check_command.estimate([s], [plain], False) for s in ("explicit", "fused"))
    )


def test_check_one_strategy_prints_one_row_per_case(small_grid, tmp_path, capsys):
    path = tmp_path / "check.json"
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--json", str(path)]) == 0
    report = _read(path)
    assert {r["strategy"] for r in report["results"]} == {"explicit"}
    assert all(r["gradcheck_passed"] is None for r in report["results"])
    assert all(r["gradgradcheck_passed"] is None for r in report["results"])

    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    # said before the first case: how many, and about how long
    seconds = check_command.estimate(["explicit"], small_grid, gradcheck=False)
    said = f"check: {len(small_grid)} steps, about {duration(seconds)} ({len(small_grid)} cases"
    assert captured.err.startswith(said)
    rows = [line for line in lines if line.startswith("explicit ")]
    assert len(rows) == len(small_grid)
    for c in small_grid:
        assert sum(c.id in row for row in rows) == 1, c.id
    assert f"explicit: {len(small_grid)} passed, 0 failed" in lines
    assert f"{len(small_grid)} passed, 0 failed" in "\n".join(lines)


def _break_one_case(monkeypatch: pytest.MonkeyPatch, message: str = "") -> str:
    """Make ``check``'s ``run_case`` fail one case (dq over its bound); returns that case's id."""
    real = check_command.run_case
    broken = SMALL_GRID[1].id

    def run_case(strategy, case, *args, **kwargs) -> CaseResult:
        result = real(strategy, case, *args, **kwargs)
        if case.id == broken:
            result.rule_passed = False
            result.errors["dq"], result.bounds["dq"] = 3e-3, 1e-3
            result.message = message
        return result

    monkeypatch.setattr(check_command, "run_case", run_case)
    return broken


def test_check_exits_1_and_reports_a_failed_case(small_grid, tmp_path, monkeypatch, capsys):
    # the command must be able to fail: break one result and see it counted
    broken = _break_one_case(monkeypatch)
    path = tmp_path / "check.json"
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--json", str(path)]) == 1
    report = _read(path)
    assert report["passed"] is False
    assert [r["case"] for r in report["results"] if not r["passed"]] == [broken]
    out = capsys.readouterr().out
    assert "1 failed" in out
    # without a message from the verifier, the table names the quantity over its bound
    assert "dq: error 3.0e-03 > bound 1.0e-03" in out


def test_check_failures_lists_only_the_failing_case_and_its_message(
    small_grid, monkeypatch, capsys
):
    message = "dq: error 3.0e-03 over its bound 1.0e-03 (2x plain PyTorch + floor)"
    broken = _break_one_case(monkeypatch, message)
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--failures"]) == 1
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("explicit ")]
    assert len(rows) == 1 and broken in rows[0]
    assert f"    {message}" in lines
    assert f"explicit: {len(small_grid) - 1} passed, 1 failed" in lines


def test_check_json_to_stdout_is_valid_json_alone(small_grid, capsys):
    assert cli.main(["check", "--strategy", "recompute", "--no-gradcheck", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # nothing else on stdout
    assert report["passed"] is True and report["attngrad"] == attngrad.__version__
    assert [r["strategy"] for r in report["results"]] == ["recompute"] * len(small_grid)
    assert "recompute: " in captured.err  # the table went to stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--strategy", "no-such-strategy"],
        ["check", "--seed", "not-a-number"],
        ["no-such-command"],
        [],
    ],
    ids=["unknown-strategy", "bad-seed", "unknown-command", "no-command"],
)
def test_bad_arguments_exit_with_code_2(argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"attngrad {attngrad.__version__}"


@pytest.mark.parametrize("command", ["check", "ledger", "explain", "bench"])
def test_every_subcommand_help_has_a_description(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    # argparse prints the description between the usage and the options
    description = out.split("\n\n")[1]
    assert not description.startswith("options:") and len(description.split()) > 10


@pytest.mark.parametrize(
    ("parse", "text", "expected"),
    [
        (positive_int, "0", "1 or more, e.g. 5, got 0"),
        (positive_int, "many", "1 or more, e.g. 5, got 'many'"),
        (positive_float, "-1", "positive number of seconds, e.g. 0.2, got -1"),
        (positive_float, "inf", "positive number of seconds, e.g. 0.2, got inf"),
        (positive_float, "soon", "number of seconds, e.g. 0.2, got 'soon'"),
        (measure_device, "tpu", "unknown device 'tpu'; use one of cpu, cuda"),
        (measure_device, "meta", "cannot measure memory on 'meta'"),
    ],
    ids=["int-zero", "int-word", "float-negative", "float-inf", "float-word", "tpu", "meta"],
)
def test_argument_types_name_the_value_and_a_fix(parse, text, expected):
    with pytest.raises(argparse.ArgumentTypeError, match=r"e\.g\.|use") as info:
        parse(text)
    assert expected in str(info.value)


def test_argument_types_accept_good_values():
    assert positive_int("1024") == 1024
    assert positive_float("0.2") == 0.2
    assert measure_device("cpu").type == "cpu"


def test_module_entry_point_runs_the_check():
    # ``python -m attngrad`` is runpy running attngrad/__main__.py as __main__: run it so, in a
    # fresh interpreter, on the small grid.  One intra-op thread, as in conftest: two cores
    # are shared with the xdist workers.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ids = [c.id for c in SMALL_GRID]
    script = "\n".join(
        [
            "import runpy, sys",
            "from attngrad.cli import check",
            "grid = check.default_cases()",
            f"check.default_cases = lambda: [c for c in grid if c.id in {ids}]",
            "check.flex_cases = lambda: []",
            "sys.argv = ['attngrad', 'check', '--no-gradcheck', '--strategy', 'explicit']",
            "runpy.run_module('attngrad', run_name='__main__', alter_sys=True)",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"explicit: {len(SMALL_GRID)} passed, 0 failed" in proc.stdout


def test_learn_and_verify_commands_are_wired(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from attngrad.cli.app import main

    assert main(["exercise", str(tmp_path / "ex"), "--lang", "en"]) == 0
    assert (tmp_path / "ex" / "attention_exercise.py").exists()
    assert main(["exercise", str(tmp_path / "ex")]) == 1  # refuses to overwrite without --force
    report = tmp_path / "verify.json"
    spec = "torch.nn.functional:scaled_dot_product_attention"
    assert main(["verify", spec, "--no-gradcheck", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["passed"] is True
    assert main(["verify", "no_such_module_xyz:attention"]) == 2
