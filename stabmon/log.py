"""The ``stabmon`` logger, with log-once and per-key rate limiting.

A training run that hits the same problem every step must not drown its own
log: each problem is logged once (``once``) or at most ``per_minute`` times a
minute per key (``limited``). The limiter lives on the Monitor that owns it, so
two monitors, or a test, never share "already logged" state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["LOGGER", "LogLimiter"]

LOGGER = logging.getLogger("stabmon")


class LogLimiter:
    """Logs each key once, or at most ``per_minute`` times per rolling minute."""

    def __init__(
        self,
        logger: logging.Logger = LOGGER,
        *,
        per_minute: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._per_minute = per_minute
        self._clock = clock
        self._seen: set[str] = set()
        self._windows: dict[str, tuple[float, int]] = {}
        # Hooks and background threads both log; the lock keeps counts exact. Re-entrant, as
        # logging's own: a signal handler that calls into stabmon may run while it is held.
        self._lock = threading.RLock()

    def once(self, key: str, level: int, message: str, *args: object) -> bool:
        """Log ``message`` the first time ``key`` is seen; return whether it was logged."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self._logger.log(level, message, *args)
        return True

    def limited(self, key: str, level: int, message: str, *args: object) -> bool:
        """Log ``message`` unless ``key`` was already logged ``per_minute`` times this minute."""
        now = self._clock()
        with self._lock:
            start, count = self._windows.get(key, (now, 0))
            if now - start >= 60.0:
                start, count = now, 0
            if count >= self._per_minute:
                self._windows[key] = (start, count)
                return False
            self._windows[key] = (start, count + 1)
        self._logger.log(level, message, *args)
        return True
