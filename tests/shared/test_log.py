"""stabmon.shared.log: log-once and per-minute limits on an injected clock, with bounded memory."""

from __future__ import annotations

import logging

import pytest

from stabmon.shared.log import MAX_ARG_CHARS, MAX_KEYS, LogLimiter


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="test.stabmon.shared.log")
    return caplog


def _limiter(per_minute: int = 10, clock: _Clock | None = None) -> LogLimiter:
    return LogLimiter(logging.getLogger("test.stabmon.shared.log"), per_minute=per_minute,
                      clock=clock or _Clock())  # fmt: skip


def test_once_logs_each_key_a_single_time(log: pytest.LogCaptureFixture) -> None:
    limiter = _limiter()

    logged = [limiter.once(key, logging.WARNING, "about %s", key) for key in ("a", "b", "a", "b")]

    assert logged == [True, True, False, False]
    assert [record.getMessage() for record in log.records] == ["about a", "about b"]


def test_once_forgets_the_oldest_key_beyond_its_bound(log: pytest.LogCaptureFixture) -> None:
    limiter = _limiter()
    for index in range(MAX_KEYS + 1):
        limiter.once(f"key-{index}", logging.INFO, "x")

    # key-0 was pushed out (memory stays flat); the newest are still remembered.
    assert limiter.once("key-0", logging.INFO, "x")
    assert not limiter.once(f"key-{MAX_KEYS}", logging.INFO, "x")


def test_limited_allows_per_minute_lines_then_a_new_window_on_the_clock(
    log: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    limiter = _limiter(per_minute=3, clock=clock)

    first = [limiter.limited("stall", logging.WARNING, "stalled") for _ in range(5)]
    clock.now += 59.9
    still_limited = limiter.limited("stall", logging.WARNING, "stalled")
    other_key = limiter.limited("leak", logging.WARNING, "leaking")
    clock.now += 0.1  # a full minute since the window opened
    next_window = [limiter.limited("stall", logging.WARNING, "stalled") for _ in range(4)]

    assert first == [True, True, True, False, False]
    assert not still_limited and other_key
    assert next_window == [True, True, True, False]
    assert len(log.records) == 3 + 1 + 3


def test_limited_with_zero_per_minute_logs_nothing(log: pytest.LogCaptureFixture) -> None:
    assert not _limiter(per_minute=0).limited("k", logging.ERROR, "never")
    assert log.records == []


def test_arguments_are_bounded_and_a_hostile_str_still_gives_a_line(
    log: pytest.LogCaptureFixture,
) -> None:
    class Hostile:
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    limiter = _limiter()
    limiter.once("long", logging.INFO, "%s|%d|%s", "x" * (MAX_ARG_CHARS + 5), 7, Hostile())

    (record,) = log.records
    text, number, hostile = record.getMessage().split("|")
    assert text == "x" * MAX_ARG_CHARS + "... (5 more characters)"
    assert (number, hostile) == ("7", "<Hostile>")
