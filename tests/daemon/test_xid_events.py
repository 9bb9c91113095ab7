"""XidWatcher against FakeNvml: counting, logging, stopping, and the unsupported paths."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_nvml import FakeGpu, FakeNvml

from stabmon.daemon.gpu import GpuPoller
from stabmon.daemon.xid_events import XidWatcher
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter

UUID_0 = "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"
UUID_1 = "GPU-8e2d7f15-5a1b-5c3d-9e4f-0a1b2c3d4e5f"

WatcherFactory = Callable[..., tuple[XidWatcher, Guard]]
FAILED_REGISTRATION = (
    "stabmon daemon: XID events unavailable, so XID errors are not counted: "
    "nvmlDeviceRegisterEvents failed: no GPU on this node supports XID events"
)


@pytest.fixture
def watcher() -> Iterator[WatcherFactory]:
    """``watcher(fake, **options)``: an XidWatcher built as the daemon builds it; stopped after.

    ``options`` go to XidWatcher (e.g. ``retry_seconds``); ``poller=`` supplies the poller.
    """
    made: list[XidWatcher] = []

    def factory(
        fake: FakeNvml, *, poller: GpuPoller | None = None, **options: Any
    ) -> tuple[XidWatcher, Guard]:
        limiter = LogLimiter()
        if poller is None:
            poller = GpuPoller(fake, limiter=limiter)
            poller.poll()
        guard = Guard(limiter, ("xid",))
        identities = poller.snapshot
        options.setdefault("wait_ms", 100)
        xid = XidWatcher(
            fake, lambda: identities().identities, guard=guard, limiter=limiter, **options
        )
        made.append(xid)
        return xid, guard

    yield factory
    for xid in made:
        xid.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


def test_xid_watcher_stops_and_its_thread_ends(watcher: WatcherFactory) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)]))
    xid.start()
    time.sleep(0.05)  # let the thread block in its wait
    xid.stop()
    assert _xid_threads() == []


def test_xid_watcher_logs_once_and_keeps_retrying_when_events_are_unsupported(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)], xid_supported=False)
    xid, guard = watcher(fake, retry_seconds=0.01)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert xid.start()
        _until(lambda: fake.calls.count("nvmlEventSetCreate") >= 3)
    assert [r.getMessage() for r in caplog.records] == [FAILED_REGISTRATION]
    assert guard.counts["xid"] == 0


def test_xid_watcher_waits_out_the_backoff_between_failed_registrations(
    watcher: WatcherFactory,
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)], xid_supported=False)
    xid, _ = watcher(fake)  # the default 10 s backoff
    assert xid.start()
    _until(lambda: "nvmlEventSetCreate" in fake.calls)
    time.sleep(0.3)
    assert fake.calls.count("nvmlEventSetCreate") == 1


def test_xid_watcher_makes_no_nvml_call_while_nvml_is_down(watcher: WatcherFactory) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)], available=False)
    xid, _ = watcher(fake, retry_seconds=0.01)
    assert xid.start()  # the thread runs regardless, waiting for NVML to come up
    time.sleep(0.3)
    assert "nvmlEventSetCreate" not in fake.calls
    assert len(_xid_threads()) == 1


def test_xid_watcher_counts_events_when_nvml_comes_up_after_start(
    watcher: WatcherFactory,
) -> None:
    fake, clock = FakeNvml([FakeGpu(UUID_0)], available=False), Clock()
    poller = GpuPoller(fake, limiter=LogLimiter(), clock=clock)
    poller.poll()
    xid, _ = watcher(fake, poller=poller)
    assert xid.start()
    fake.available = True
    clock.now += 60.0  # the poller's next init is due
    poller.poll()
    assert poller.nvml_up
    fake.push_xid(0, 79)
    _until(lambda: xid.counts() == {(0, UUID_0, 79): 1})


def test_xid_watcher_retries_a_failed_registration_until_it_succeeds(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)])
    xid, guard = watcher(fake, retry_seconds=0.05)
    fake.failing = True
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert xid.start()
        _until(lambda: "nvmlEventSetCreate" in fake.calls)
    fake.failing = False
    fake.push_xid(0, 48)
    _until(lambda: xid.counts() == {(0, UUID_0, 48): 1})
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "stabmon daemon: XID events unavailable, so XID errors are not counted: "
        "nvmlEventSetCreate failed: Unknown Error"
    ]
    assert guard.counts["xid"] == 0


def test_xid_watcher_registers_a_new_event_set_after_a_failed_wait(
    watcher: WatcherFactory,
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)])
    xid, _ = watcher(fake, retry_seconds=0.05)
    assert xid.start()
    fake.push_xid(0, 79)
    _until(lambda: xid.counts() == {(0, UUID_0, 79): 1})
    fake.break_xid_events()  # e.g. GPU_IS_LOST: the old set never works again
    fake.push_xid(0, 48)
    _until(lambda: xid.counts() == {(0, UUID_0, 79): 1, (0, UUID_0, 48): 1})
    assert fake.calls.count("nvmlEventSetFree") == 1
    assert fake.calls.count("nvmlEventSetCreate") == 2


def test_xid_watcher_logs_a_wait_failure_again_after_events_resumed(
    watcher: WatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)])
    xid, _ = watcher(fake, retry_seconds=0.05)

    def wait_failures() -> int:
        return sum("waiting for XID events failed" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert xid.start()
        _until(lambda: fake.calls.count("nvmlEventSetCreate") == 1)
        fake.break_xid_events()
        _until(lambda: wait_failures() == 1)
        _until(lambda: fake.calls.count("nvmlEventSetCreate") == 2)  # resumed
        fake.break_xid_events()  # the same failure, with the same text, a second time
        _until(lambda: wait_failures() == 2)


def test_xid_watcher_request_stop_returns_at_once_and_the_thread_ends(
    watcher: WatcherFactory,
) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)]), wait_ms=300)
    assert xid.start()
    time.sleep(0.05)  # let the thread block in its wait
    xid.request_stop()
    assert _xid_threads()  # returned while the thread still waits: it did not join it
    _until(lambda: _xid_threads() == [], timeout=1.0)


def test_xid_watcher_stop_waits_at_most_its_timeout(watcher: WatcherFactory) -> None:
    xid, _ = watcher(FakeNvml([FakeGpu(UUID_0)]), wait_ms=2000)
    assert xid.start()
    time.sleep(0.05)
    xid.stop(timeout=0.1)
    assert _xid_threads()  # returned after its timeout, while the thread waits out its 2 s
    assert xid.start() is False  # a stopped watcher does not start again
    _until(lambda: _xid_threads() == [], timeout=10.0)


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
        xid.stop()  # the thread now sleeps 10 s before re-registering; stop must not wait for it
    assert len(caplog.records) == 1
    assert guard.counts["xid"] == 0  # an NVML failure is expected, not a stabmon bug


def test_xid_watcher_contains_unexpected_errors_in_the_guard(watcher: WatcherFactory) -> None:
    class BrokenWait(FakeNvml):
        def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
            raise ZeroDivisionError("a bug, not an NVML failure")

    xid, guard = watcher(BrokenWait([FakeGpu(UUID_0)]))
    assert xid.start()
    _until(lambda: guard.counts["xid"] >= 1)
    xid.stop()
