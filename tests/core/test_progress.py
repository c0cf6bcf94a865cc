"""`attngrad.core.progress`: the bar says up front how long, and how long is left as it goes."""

from __future__ import annotations

import io

import pytest

from attngrad.core import progress
from attngrad.core.progress import Progress, duration


class _Clock:
    """perf_counter under the test's control."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(progress.time, "perf_counter", c)
    return c


def test_the_time_left_follows_the_weights(clock: _Clock) -> None:
    # two steps of work 1 then two of work 3: after the first (10 s), 70 s are left
    stream = io.StringIO()
    with Progress(4, "bench", stream, weights=[1, 1, 3, 3], estimate=(120, "a guess")) as bar:
        assert stream.getvalue() == "bench: 4 steps, about 2 min (a guess)\n"
        clock.now = 10.0
        bar.step("N=64")
        assert bar.left() == pytest.approx(70.0)
        assert "1/4  10.0s, ~70 s left N=64" in stream.getvalue()
        for _ in range(3):
            clock.now += 30.0
            bar.step()
    assert stream.getvalue().splitlines()[-1].endswith("4/4 100.0s ")  # nothing left to say


def test_equal_steps_without_weights(clock: _Clock) -> None:
    stream = io.StringIO()
    with Progress(10, "check", stream) as bar:
        assert bar.left() is None and stream.getvalue() == ""  # no estimate: nothing up front
        clock.now = 6.0
        for _ in range(3):
            bar.step()
        assert bar.left() == pytest.approx(14.0)


def test_weights_must_match_the_steps() -> None:
    with pytest.raises(ValueError, match=r"one weight per step \(3\), got 2"):
        Progress(3, "bench", io.StringIO(), weights=[1.0, 2.0])


@pytest.mark.parametrize(
    ("seconds", "said"),
    [(0.2, "1 s"), (89, "89 s"), (91, "2 min"), (3599, "1 h"), (4800, "1 h 20 min")],
)
def test_durations_read_as_people_say_them(seconds: float, said: str) -> None:
    assert duration(seconds) == said
