"""Never break training: contain, count and log every failure inside stabmon.

Every hook body and every background-thread iteration runs under
:meth:`Guard.contain` (or calls :meth:`Guard.record` from a hand-written
``try``/``except`` where a context manager would cost too much per step). A
contained error increments ``stabmon_internal_errors_total{component}`` and is
logged once per component and exception type; training goes on. Only
``Exception`` is caught: ``KeyboardInterrupt`` and ``SystemExit`` belong to the
user.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from stabmon.shared.log import LogLimiter

__all__ = ["Guard"]


class Guard:
    """Counts contained failures per component and logs each kind once."""

    def __init__(self, limiter: LogLimiter, components: Iterable[str] = ()) -> None:
        self._limiter = limiter
        self._counts: dict[str, int] = dict.fromkeys(components, 0)
        # Re-entrant: a signal handler that calls into stabmon may run while it is held.
        self._lock = threading.RLock()

    @property
    def counts(self) -> Mapping[str, int]:
        """Contained failures so far, by component (read by the exporter)."""
        return self._counts

    def count(self, component: str) -> None:
        """Count a failure in ``component`` whose owner already logged it in its own words."""
        with self._lock:
            self._counts[component] = self._counts.get(component, 0) + 1

    def record(self, component: str, error: BaseException) -> None:
        """Count ``error`` against ``component`` and log it the first time it is seen."""
        try:
            with self._lock:
                self._counts[component] = self._counts.get(component, 0) + 1
            self._limiter.once(
                f"internal:{component}:{type(error).__name__}",
                logging.WARNING,
                "stabmon: contained an error in %s (training goes on; counted in "
                "stabmon_internal_errors_total): %s: %s",
                component,
                type(error).__name__,
                error,
                # exc_info would pin the frame, and with it tensors, in the logger.
            )
        except Exception:  # the guard itself must never raise
            pass

    @contextmanager
    def contain(self, component: str) -> Iterator[None]:
        """Run the block; an ``Exception`` inside it is recorded, not raised."""
        try:
            yield
        except Exception as error:  # containing everything is the point
            self.record(component, error)
