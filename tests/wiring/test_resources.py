"""stabmon.wiring.resources.Resources: the one bounded shutdown of what a Monitor holds.

Real parts where cheap: a real registration record, a real event log and a real
Exporter on port 0, real PeriodicThreads. The one-deadline rule is checked with
threads that never stop (a small stand-in with PeriodicThread's request_stop/join) on
an injected ``time.monotonic`` (stabmon.wiring.resources' only): a join that times out moves
the clock by its timeout.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter
from stabmon.shared.background import PeriodicThread
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import ProcessRecord
from stabmon.wiring import resources as resources_module
from stabmon.wiring.resources import SHUTDOWN_SECONDS, Resources


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class HungThread:
    """A thread that ignores its stop request: each join waits out its whole timeout."""

    def __init__(self, clock: FakeClock, log: list[str], name: str) -> None:
        self._clock, self._log, self._name = clock, log, name
        self.timeouts: list[float] = []

    def request_stop(self) -> None:
        self._log.append(f"stop {self._name}")

    def join(self, timeout: float) -> None:
        self._log.append(f"join {self._name}")
        self.timeouts.append(timeout)
        self._clock.now += max(timeout, 0.0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    # Only stabmon.wiring.resources reads this clock: the time module itself is left alone.
    monkeypatch.setattr(resources_module, "time", SimpleNamespace(monotonic=fake))
    return fake


def test_close_asks_every_thread_to_stop_before_waiting_for_any(clock: FakeClock) -> None:
    log: list[str] = []
    threads = [HungThread(clock, log, name) for name in ("a", "b", "c")]
    Resources(threads=threads).close()  # type: ignore[arg-type]
    assert log == ["stop a", "stop b", "stop c", "join a", "join b", "join c"]


def test_close_waits_for_hung_threads_against_one_deadline_not_one_each(
    clock: FakeClock,
) -> None:
    threads = [HungThread(clock, [], str(index)) for index in range(5)]
    started = clock.now
    Resources(threads=threads).close()  # type: ignore[arg-type]
    assert clock.now - started == SHUTDOWN_SECONDS
    assert threads[0].timeouts == [SHUTDOWN_SECONDS]
    assert all(t.timeouts[0] <= 0.0 for t in threads[1:])


def test_close_honours_a_deadline_it_is_given(clock: FakeClock) -> None:
    thread = HungThread(clock, [], "a")
    Resources(threads=[thread]).close(deadline=clock.now + 0.25)  # type: ignore[list-item]
    assert thread.timeouts == [0.25]


def test_close_stops_real_threads_and_releases_real_files_and_ports(tmp_path: Path) -> None:
    guard = Guard(LogLimiter())
    record = tmp_path / "run" / "rank-0.json"
    registration = Registration(
        tmp_path, record, ProcessRecord(pid=os.getpid(), create_time=0.0, run="run", rank=0)
    )
    registration.write(last_step_unix=None, steps=0, now=1.0)
    events = EventLog(tmp_path / "run" / "rank-0.events.jsonl", common={}, guard=guard)
    exporter = Exporter(CollectorRegistry(), address="127.0.0.1", ports=[0], limiter=LogLimiter())
    assert exporter.start()
    thread = PeriodicThread("test-tick", 0.01, lambda: None, guard=guard, component="test")
    thread.start()
    held = Resources(threads=[thread], exporter=exporter, events=events, registration=registration)
    held.close()
    assert not thread.alive
    assert exporter.url is None
    assert not record.exists()
    events.write("late", step=1)  # after close: dropped, never a reopened file
    assert "late" not in (tmp_path / "run" / "rank-0.events.jsonl").read_text()


def test_close_of_nothing_does_nothing() -> None:
    Resources().close()
