"""The one writer of what the commands show and write.

Every command computes rows (in `attngrad.verify`, `attngrad.tools`,
`attngrad.learn`) and writes them here: aligned text `columns` or a `markdown`
table, CSV (`write_csv`, with the `attngrad.tools.machine.Machine` columns on every
row), JSON (`write_json`) and PNG figures (`figure`, which needs matplotlib: without
it a ModuleNotFoundError whose message says how to install it, `PLOT_INSTALL`).
`destination` and `write_file` say where a file goes and that it went; the small
cell formats (`yes`, `verdict`) are alike in every table.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from attngrad.tools.machine import Machine

__all__ = [
    "PLOT_INSTALL",
    "columns",
    "destination",
    "figure",
    "markdown",
    "verdict",
    "write_csv",
    "write_file",
    "write_json",
    "yes",
]

PLOT_INSTALL = "matplotlib is not installed; install it with `pip install 'attngrad[plot]'`"


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def verdict(passed: bool | None) -> str:
    """``pass``, ``FAIL``, or ``-`` where nothing was judged."""
    return {None: "-", True: "pass", False: "FAIL"}[passed]


def columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: int
) -> tuple[str, list[str]]:
    """The header line and one line per row, every column as wide as its widest cell;
    the first ``left`` columns align left, the others right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{c:<{w}}" if i < left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return line(header), [line(r) for r in rows]


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (header, *rows)]
    lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
    return lines


def write_csv(
    records: Sequence[Mapping[str, object]],
    path: str | os.PathLike[str],
    machine: Machine | None = None,
) -> None:
    """One line per record (columns from the first), then ``machine``'s columns."""
    if not records:
        raise ValueError(f"write_csv needs at least one record for {os.fspath(path)!r}, got none")
    extra = machine.columns() if machine is not None else {}
    clash = sorted(set(records[0]) & set(extra))
    if clash:
        raise ValueError(f"records have the machine's columns {clash}; rename them in the records")
    fields = [*records[0], *extra]
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({**r, **extra} for r in records)


def write_json(payload: object, path: str, out: TextIO) -> None:
    """``payload`` as indented JSON to ``path``, or to stdout when it is "-" (notes go to ``out``)."""
    text = json.dumps(payload, indent=2, ensure_ascii=False)
    if path == "-":
        print(text)
        return
    with open(path, "w", encoding="utf-8") as f:  # utf-8: the grader's hints and Chinese text
        f.write(text)
    print(f"wrote {path}", file=out)


@contextmanager
def figure(path: str | os.PathLike[str], width: float, height: float) -> Iterator[Any]:
    """A matplotlib Figure to draw on, saved to ``path`` as PNG on exit.

    The figure's title (``fig.suptitle``) is wrapped to the figure's width when it is
    saved: a machine line longer than the panels stays inside the picture.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ModuleNotFoundError(PLOT_INSTALL) from e
    fig = Figure(figsize=(width, height), layout="constrained")
    yield fig
    if title := fig.get_suptitle():
        fig.suptitle(title, wrap=True)
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


def destination(given: str | None, default: str | None) -> str | None:
    """Where to write a file: ``default`` when the flag is absent, nowhere for ``''``."""
    return default if given is None else (given or None)


def write_file(path: str | None, write: Callable[[str], None]) -> None:
    """``write(path)`` and say so; a plot without matplotlib says how to install it and
    the command goes on."""
    if not path:
        return
    try:
        write(path)
    except ModuleNotFoundError as e:
        print(f"skipped the plot {path}: {e}", file=sys.stderr)
        return
    print(f"wrote {path}")
