"""stabmon.shared.guard: a contained failure is counted every time, logged once, and never
raised."""

from __future__ import annotations

import logging

import pytest

from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


@pytest.fixture
def guard() -> Guard:
    return Guard(LogLimiter(logging.getLogger("test.stabmon.shared.guard")), components=("hooks",))


def test_contain_swallows_an_exception_and_counts_it_per_component(
    guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="test.stabmon.shared.guard")
    for _ in range(3):
        with guard.contain("hooks"):
            raise ValueError("bad reading")
    with guard.contain("export"):
        raise KeyError("family")

    assert guard.counts == {"hooks": 3, "export": 1}
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2  # once per component and exception type
    assert messages[0] == (
        "stabmon: contained an error in hooks (training goes on; counted in "
        "stabmon_internal_errors_total): ValueError: bad reading"
    )
    assert caplog.records[0].exc_info is None  # no frame (and its tensors) pinned in the logger


def test_contain_logs_a_new_exception_type_of_the_same_component(
    guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="test.stabmon.shared.guard")
    with guard.contain("hooks"):
        raise ValueError("one")
    with guard.contain("hooks"):
        raise TypeError("two")

    assert guard.counts == {"hooks": 2}
    assert len(caplog.records) == 2


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(1)])
def test_contain_lets_keyboard_interrupt_and_system_exit_through(
    guard: Guard, error: BaseException
) -> None:
    with pytest.raises(type(error)), guard.contain("hooks"):
        raise error
    assert guard.counts == {"hooks": 0}


def test_record_never_raises_even_when_logging_fails() -> None:
    class Broken(LogLimiter):
        def once(self, key: str, level: int, message: str, *args: object) -> bool:
            raise OSError("log disk full")

    guard = Guard(Broken())

    guard.record("sampler", RuntimeError("x"))

    assert guard.counts == {"sampler": 1}


def test_count_adds_a_failure_its_owner_already_logged(guard: Guard) -> None:
    guard.count("hooks")
    guard.count("daemon")
    assert guard.counts == {"hooks": 1, "daemon": 1}
