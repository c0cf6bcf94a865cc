"""The ``attngrad`` command: check's exit codes, JSON report and table; the argparse
types; --version, every subcommand's description and ``python -m attngrad``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import attngrad
from attngrad.cli import app as cli
from attngrad.cli import check as check_command
from attngrad.cli.args import measure_device, positive_float, positive_int
from attngrad.verify.cases import default_cases
from attngrad.verify.check import CaseResult


def _read(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_check_json_has_one_passing_result_per_strategy_and_case(tmp_path):
    path = tmp_path / "check.json"
    assert cli.main(["check", "--json", str(path)]) == 0
    report = _read(path)
    cases = [c.id for c in default_cases()]
    assert report["passed"] is True
    assert report["strategies"] == list(attngrad.STRATEGIES)
    got = [(r["strategy"], r["case"]) for r in report["results"]]
    assert sorted(got) == sorted((s, c) for s in attngrad.STRATEGIES for c in cases)
    failed = [r for r in report["results"] if r["passed"] is not True]
    assert not failed, failed[:3]
    # float64 cases also ran gradcheck; the others have no gradcheck verdict
    for r in report["results"]:
        assert r["gradcheck_passed"] is (True if r["dtype"] == "float64" else None)


def test_check_one_strategy_prints_one_row_per_case(tmp_path, capsys):
    path = tmp_path / "check.json"
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--json", str(path)]) == 0
    report = _read(path)
    assert {r["strategy"] for r in report["results"]} == {"explicit"}
    assert all(r["gradcheck_passed"] is None for r in report["results"])

    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("explicit ")]
    assert len(rows) == len(default_cases())
    for case in default_cases():
        assert sum(case.id in row for row in rows) == 1, case.id
    assert f"explicit: {len(default_cases())} passed, 0 failed" in lines
    assert f"{len(default_cases())} passed, 0 failed" in "\n".join(lines)


def _break_one_case(monkeypatch: pytest.MonkeyPatch, message: str = "") -> str:
    """Make ``check``'s ``run_case`` fail one case (dq over its bound); returns that case's id."""
    real = check_command.run_case
    broken = default_cases()[5].id

    def run_case(strategy, case, *args, **kwargs) -> CaseResult:
        result = real(strategy, case, *args, **kwargs)
        if case.id == broken:
            result.rule_passed = False
            result.errors["dq"], result.bounds["dq"] = 3e-3, 1e-3
            result.message = message
        return result

    monkeypatch.setattr(check_command, "run_case", run_case)
    return broken


def test_check_exits_1_and_reports_a_failed_case(tmp_path, monkeypatch, capsys):
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


def test_check_failures_lists_only_the_failing_case_and_its_message(monkeypatch, capsys):
    message = "dq: error 3.0e-03 over its bound 1.0e-03 (2x plain PyTorch + floor)"
    broken = _break_one_case(monkeypatch, message)
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--failures"]) == 1
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("explicit ")]
    assert len(rows) == 1 and broken in rows[0]
    assert f"    {message}" in lines
    assert f"explicit: {len(default_cases()) - 1} passed, 1 failed" in lines


def test_check_json_to_stdout_is_valid_json_alone(capsys):
    assert cli.main(["check", "--strategy", "recompute", "--no-gradcheck", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # nothing else on stdout
    assert report["passed"] is True and report["attngrad"] == attngrad.__version__
    assert {r["strategy"] for r in report["results"]} == {"recompute"}
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
    # one intra-op thread, as in conftest: two cores are shared with the xdist workers
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "attngrad", "check", "--no-gradcheck", "--strategy", "explicit"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{len(default_cases())} passed, 0 failed" in proc.stdout


def test_check_reports_the_higher_derivatives_of_float64_cases(tmp_path, capsys):
    path, csv_path = tmp_path / "check.json", tmp_path / "check.csv"
    argv = ["check", "--strategy", "flash", "--json", str(path), "--csv", str(csv_path)]
    assert cli.main(argv) == 0
    for r in _read(path)["results"]:
        float64 = r["dtype"] == "float64"
        assert (r["second_order_error"] is not None) is float64, r["case"]
        assert r["gradgradcheck_passed"] is (True if float64 else None), r["case"]
        if float64:
            assert r["second_order_error"] < 1e-13 and r["jvp_error"] < 1e-13
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-3:] == ["d2", "jvp", "gradgrad"]
    assert f"wrote {csv_path}" in out
    with csv_path.open(encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 1 + len(default_cases())


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
