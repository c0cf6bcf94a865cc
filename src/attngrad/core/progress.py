"""A dependency-free progress bar on stderr for long CLI jobs."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, "check") as bar: bar.step("case id")``.

    Redraws one line in a terminal; elsewhere (CI logs) prints a line at each
    tenth of the way so the log stays short.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()
        self._last_tenth = -1

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def step(self, note: str = "") -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        elapsed = time.perf_counter() - self.start
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{self.done}/{self.total} {elapsed:5.1f}s {note}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
        elif (tenth := 10 * self.done // self.total) != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()
