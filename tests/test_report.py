"""`attngrad.report`: the pieces every command's output shares."""

from __future__ import annotations

import csv

import pytest

from attngrad.machine import Machine
from attngrad.report import format_bytes, write_csv

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
