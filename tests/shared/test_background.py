"""PeriodicThread: runs its task, contains its failures, and stops when asked."""

from __future__ import annotations

import threading

from stabmon.shared.background import PeriodicThread
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


def test_periodic_thread_keeps_running_after_its_task_fails() -> None:
    guard = Guard(LogLimiter(), ("sampler",))
    calls: list[int] = []
    done = threading.Event()

    def task() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first call fails")
        done.set()

    thread = PeriodicThread("test-periodic", 0.001, task, guard=guard, component="sampler")
    thread.start()
    try:
        assert done.wait(30), "the thread stopped after its task failed"
    finally:
        thread.stop(timeout=30)
    assert guard.counts["sampler"] == 1
    assert not thread.alive


def test_periodic_thread_stops_while_waiting_out_a_long_interval() -> None:
    guard = Guard(LogLimiter())
    thread = PeriodicThread("test-idle", 3600.0, lambda: None, guard=guard, component="x")
    thread.start()
    thread.request_stop()  # the wait on the stop event ends at once, not after an hour
    thread.join(30)
    assert not thread.alive


def test_periodic_thread_join_from_its_own_task_returns() -> None:
    guard = Guard(LogLimiter(), ("x",))
    joined = threading.Event()
    holder: list[PeriodicThread] = []

    def task() -> None:
        holder[0].stop(timeout=30)  # a task that stops its own thread must not deadlock
        joined.set()

    thread = PeriodicThread("test-self-stop", 0.001, task, guard=guard, component="x")
    holder.append(thread)
    thread.start()
    assert joined.wait(30)
    thread.join(30)
    assert not thread.alive and guard.counts["x"] == 0
