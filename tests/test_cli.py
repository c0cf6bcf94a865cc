"""The ``attngrad check`` command: exit codes, JSON report, table, argparse errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import attngrad
from attngrad import cli
from attngrad.verify import CaseResult, default_cases


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
    assert f"{len(default_cases())} passed, 0 failed" in "\n".join(lines)


def test_check_exits_1_and_reports_a_failed_case(tmp_path, monkeypatch, capsys):
    # the command must be able to fail: break one result and see it counted
    real = cli.run_case
    broken = default_cases()[5].id

    def run_case(strategy, case, *args, **kwargs) -> CaseResult:
        result = real(strategy, case, *args, **kwargs)
        if case.id == broken:
            result.rule_passed = False
        return result

    monkeypatch.setattr(cli, "run_case", run_case)
    path = tmp_path / "check.json"
    assert cli.main(["check", "--strategy", "explicit", "--no-gradcheck", "--json", str(path)]) == 1
    report = _read(path)
    assert report["passed"] is False
    assert [r["case"] for r in report["results"] if not r["passed"]] == [broken]
    assert "1 failed" in capsys.readouterr().out


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


def test_module_entry_point_runs_the_check():
    # one intra-op thread, as in conftest: two cores are shared with the xdist workers
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "attngrad.cli", "check", "--no-gradcheck", "--strategy", "explicit"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{len(default_cases())} passed, 0 failed" in proc.stdout
