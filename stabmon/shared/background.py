"""A daemon thread that runs one task at a fixed interval and stops within a second.

Each iteration runs under the monitor's :class:`~stabmon.shared.guard.Guard`, so a
failing task is counted and logged once and the thread keeps going. ``stop``
sets an event the thread waits on, so it returns promptly however long the
interval is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from stabmon.shared.guard import Guard
from stabmon.shared.threads import start_without_signals

__all__ = ["PeriodicThread"]


class PeriodicThread:
    """Runs ``task`` every ``interval`` seconds in a daemon thread until ``stop``."""

    def __init__(
        self,
        name: str,
        interval: float,
        task: Callable[[], None],
        *,
        guard: Guard,
        component: str,
    ) -> None:
        self._interval = interval
        self._task = task
        self._guard = guard
        self._component = component
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        start_without_signals(self._thread)

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` seconds for it."""
        self.request_stop()
        self.join(timeout)

    def request_stop(self) -> None:
        """Ask the thread to end without waiting (to stop several against one deadline)."""
        self._stopping.set()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(max(timeout, 0.0))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            with self._guard.contain(self._component):
                self._task()
