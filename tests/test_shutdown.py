"""Shutdown against one deadline: every thread is asked to stop before any is waited for."""

from __future__ import annotations

import time

import stabmon.wiring.resources as resources_module


class _RecordingThread:
    """Stands in for a PeriodicThread stuck in its task: joins never see it end."""

    def __init__(self, name: str, calls: list[tuple[str, str, float | None]]) -> None:
        self.name = name
        self._calls = calls

    def request_stop(self) -> None:
        self._calls.append(("request_stop", self.name, None))

    def join(self, timeout: float) -> None:
        self._calls.append(("join", self.name, timeout))

    def stop(self, timeout: float = 1.0) -> None:  # the old path: stop-and-wait, one by one
        self._calls.append(("stop", self.name, timeout))


def test_resources_close_asks_every_thread_to_stop_before_waiting_for_any() -> None:
    calls: list[tuple[str, str, float | None]] = []
    resources = resources_module.Resources()
    resources.threads = [_RecordingThread(n, calls) for n in ("a", "b", "c")]  # type: ignore[misc]
    resources.close()
    kinds = [kind for kind, _, _ in calls]
    assert kinds == ["request_stop"] * 3 + ["join"] * 3


def test_resources_close_waits_for_all_threads_against_one_deadline() -> None:
    calls: list[tuple[str, str, float | None]] = []
    resources = resources_module.Resources()
    resources.threads = [_RecordingThread(n, calls) for n in ("a", "b", "c")]  # type: ignore[misc]
    deadline = time.monotonic() + 0.75
    resources.close(deadline)
    timeouts = [timeout for kind, _, timeout in calls if kind == "join"]
    assert timeouts and all(t is not None and t <= 0.75 for t in timeouts)
    # One deadline, not one budget each: the waits shrink toward it, never reset.
    assert timeouts == sorted(timeouts, key=lambda t: -float(t or 0.0))
