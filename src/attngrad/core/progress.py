"""A dependency-free progress bar on stderr for long CLI jobs, with the time left."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["Progress", "duration"]


def duration(seconds: float) -> str:
    """A rounded duration for people: ``"45 s"``, ``"3 min"``, ``"1 h 20 min"``.

    >>> duration(44.6), duration(170), duration(4800)
    ('45 s', '3 min', '1 h 20 min')
    """
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    if not hours:
        return f"{minutes} min"
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


class Progress:
    """``with Progress(total, "check") as bar: bar.step("case id")``.

    Redraws one line in a terminal; elsewhere (CI logs) prints a line at each
    tenth of the way so the log stays short.  Each line says how long the rest
    will take, from the time so far: ``weights`` (one per step, e.g. its FLOPs)
    tell a long step from a short one, else every step counts alike.  With
    ``estimate`` (seconds, and what it rests on) the bar says up front how long
    the whole job should take, before its first step.
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        width: int = 30,
        weights: Sequence[float] | None = None,
        estimate: tuple[float, str] | None = None,
    ):
        if weights is not None and len(weights) != total:
            raise ValueError(f"weights must hold one weight per step ({total}), got {len(weights)}")
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.weights = list(weights) if weights is not None else [1.0] * total
        self.estimate = estimate
        self.done = 0
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()
        self._last_tenth = -1

    def __enter__(self) -> Progress:
        if self.estimate is not None:
            seconds, basis = self.estimate
            self.stream.write(
                f"{self.label}: {self.total} steps, about {duration(seconds)} ({basis})\n"
            )
            self.stream.flush()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def left(self) -> float | None:
        """Seconds the remaining steps should take at the pace so far (None before a step)."""
        done = sum(self.weights[: self.done])
        if self.done == 0 or done <= 0:
            return None
        elapsed = time.perf_counter() - self.start
        return elapsed * sum(self.weights[self.done :]) / done

    def step(self, note: str = "") -> None:
        self.done += 1
        filled = self.width * min(self.done, self.total) // self.total
        elapsed = time.perf_counter() - self.start
        left = self.left()
        eta = "" if left is None or self.done >= self.total else f", ~{duration(left)} left"
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{self.done}/{self.total} {elapsed:5.1f}s{eta} {note}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
        elif (tenth := 10 * self.done // self.total) != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()
