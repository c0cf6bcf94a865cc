"""`attngrad.cli.table` and `attngrad.cli.check`: the pieces every command's output shares."""

from __future__ import annotations

import csv

import pytest

from attngrad.cli.check import check_records, check_summary, check_table
from attngrad.cli.table import columns, markdown, write_csv
from attngrad.tools.machine import Machine
from attngrad.tools.memory import format_bytes
from attngrad.verify.check import CaseResult

MACHINE = Machine("a test CPU", 4, "float32", 1024, 99.5)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "-"),
        (840, "840 B"),
        (1536, "1.50 KiB"),
        (536 * 2**20, "536.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
    ],
)
def test_format_bytes_is_exact_while_small(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


def test_write_csv_appends_the_machine_to_every_row(tmp_path) -> None:
    path = tmp_path / "deep" / "rows.csv"
    write_csv([{"n": 1, "ms": "2.5"}, {"n": 2, "ms": "9"}], path, MACHINE)
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert [r["n"] for r in rows] == ["1", "2"]
    assert all(r["machine"] == "a test CPU" and r["threads"] == "4" for r in rows)


@pytest.mark.parametrize(
    ("records", "match"),
    [([], "at least one record"), ([{"threads": 1}], r"machine's columns \['threads'\]")],
    ids=["no-records", "column-clash"],
)
def test_write_csv_refuses_what_it_cannot_write(tmp_path, records, match) -> None:
    with pytest.raises(ValueError, match=match):
        write_csv(records, tmp_path / "rows.csv", MACHINE)


def _result(**fields: object) -> CaseResult:
    base = dict(strategy="flash", case="B1-H2-N4-d4-float64-none", dtype="float64",
                errors={"out": 1e-16}, ratios={"out": 0.1}, bounds={"out": 1e-15},
                rule_passed=True, gradcheck_passed=True)  # fmt: skip
    return CaseResult(**{**base, **fields})  # type: ignore[arg-type]


def test_check_table_shows_the_higher_derivatives_and_fails_a_wrong_one() -> None:
    good = _result(second_order_error=3e-16, jvp_error=2e-16, gradgradcheck_passed=True)
    bad = _result(second_order_error=2e-6, jvp_error=2e-16, gradgradcheck_passed=True)
    assert good.passed and not bad.passed
    lines = check_table([good, bad]).splitlines()
    assert lines[0].split()[-3:] == ["d2", "jvp", "gradgrad"]
    assert lines[1].split()[-3:] == ["3.0e-16", "2.0e-16", "pass"]
    assert lines[3] == "    second_order: relative error 2.0e-06 > 1e-09"
    assert "1e-09 passes" in check_summary([good])


def test_check_records_carry_the_higher_derivatives(tmp_path) -> None:
    path = tmp_path / "check.csv"
    write_csv(check_records([_result(second_order_error=3e-16, jvp_error=None)]), path)
    (row,) = csv.DictReader(path.open(encoding="utf-8"))
    assert row["second_order_error"] == "3e-16" and row["jvp_error"] == ""
    assert row["gradgradcheck_passed"] == "" and row["passed"] == "True"
    assert row["error_out"] == "1e-16" and row["error_dmask"] == ""


def test_columns_align_left_then_right() -> None:
    head, lines = columns(["name", "ms"], [["flash", "1.5"], ["explicit", "12.25"]], left=1)
    assert [head, *lines] == ["name         ms", "flash       1.5", "explicit  12.25"]


def test_markdown_has_a_rule_under_the_header() -> None:
    assert markdown(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]
