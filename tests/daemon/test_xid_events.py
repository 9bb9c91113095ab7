"""XidWatcher against FakeNvml: counting, logging, stopping, and the unsupported paths."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from fake_nvml import FakeGpu, FakeNvml

from stabmon.daemon.gpu import GpuPoller
from stabmon.daemon.xid_events import XidWatcher
from stabmon.guard import Guard
from stabmon.log import LogLimiter

UUID_0 = "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"
UUID_1 = "GPU-8e2d7f15-5a1b-5c3d-9e4f-0a1b2c3d4e5f"

WatcherFactory = Callable[[FakeNvml], tuple[XidWatcher, Guard]]


@pytest.fixture
def watcher() -> Iterator[WatcherFactory]:
    """``watcher(fake)``: an XidWatcher built as the daemon builds it; stopped after the test."""
    made: list[XidWatcher] = []

    def factory(fake: FakeNvml) -> tuple[XidWatcher, Guard]:
        limiter = LogLimiter()
        poller = GpuPoller(fake, limiter=limiter)
        poller.poll()
        guard = Guard(limiter, ("xid",))
        xid = XidWatcher(
            fake, lambda: poller.snapshot().identities, guard=guard, limiter=limiter, wait_ms=100
        )
        made.append(xid)
        return xid, guard

    yield factory
    for xid in made:
        xid.stop()


def _until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _xid_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stabmon-daemon-xid"]


def test_xid_watcher_counts_events_per_gpu_uuid_and_xid(watcher: WatcherFactory) -> None:
    fake = FakeNvml([FakeGpu(UUID_0), FakeGpu(UUID_1)])
    xid, _ = watcher(fake)
    assert xid.start()
    for gpu, code in [(0, 79), (1, 48), (0, 79)]:
        fake.push_xid(gpu, code)
    expected = {(0, UUID_0, 79): 2, (1, UUID_1, 48): 1}
    _until(lambda: xid.counts() == expected)


def test_xid_watcher_logs_each_event_with_gpu_uuid_and_xid(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)])
    xid, _ = watcher(fake)
    with caplog.at_level(logging.ERROR, logger="stabmon"):
        xid.start()
        fake.push_xid(0, 79)
        _until(lambda: bool(xid.counts()))
        xid.stop()
    (record,) = caplog.records
    assert record.getMessage().startswith(f"stabmon daemon: XID 79 on GPU 0 ({UUID_0})")


def test_xid_watcher_stops_within_a_second(watcher: WatcherFactory) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)]))
    xid.start()
    time.sleep(0.05)  # let the thread block in its wait
    started = time.monotonic()
    xid.stop()
    assert time.monotonic() - started < 1.0
    assert _xid_threads() == []


def test_xid_watcher_start_returns_false_and_logs_once_when_events_are_unsupported(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)], xid_supported=False))
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert xid.start() is False
        assert xid.start() is False
    assert [r.getMessage() for r in caplog.records] == [
        "stabmon daemon: XID events unavailable, so XID errors are not counted: "
        "nvmlDeviceRegisterEvents failed: no GPU on this node supports XID events"
    ]
    assert _xid_threads() == []


def test_xid_watcher_start_returns_false_when_nvml_is_down(watcher: WatcherFactory) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)], available=False))
    assert xid.start() is False


def test_xid_watcher_logs_once_and_stays_stoppable_when_nvml_fails_mid_run(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)])
    xid, guard = watcher(fake)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        xid.start()
        fake.failing = True
        _until(
            lambda: any("waiting for XID events failed" in r.getMessage() for r in caplog.records)
        )
        started = time.monotonic()
        xid.stop()  # the thread now sleeps 10 s before re-registering; stop must not wait for it
    assert time.monotonic() - started < 1.0
    assert len(caplog.records) == 1
    assert guard.counts["xid"] == 0  # an NVML failure is expected, not a stabmon bug


def test_xid_watcher_contains_unexpected_errors_in_the_guard(watcher: WatcherFactory) -> None:
    class BrokenWait(FakeNvml):
        def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
            raise ZeroDivisionError("a bug, not an NVML failure")

    xid, guard = watcher(BrokenWait([FakeGpu(UUID_0)]))
    assert xid.start()
    _until(lambda: guard.counts["xid"] >= 1)
    started = time.monotonic()
    xid.stop()
    assert time.monotonic() - started < 1.0
