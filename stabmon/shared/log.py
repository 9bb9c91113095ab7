"""The ``stabmon`` logger, with log-once and per-key rate limiting.

A training run that hits the same problem every step must not drown its own
log: each problem is logged once (``once``) or at most ``per_minute`` times a
minute per key (``limited``). The limiter lives on the Monitor that owns it, so
two monitors, or a test, never share "already logged" state.

Keys and arguments often carry what someone else wrote (a record's path, a
malformed value), so both are bounded: at most ``MAX_KEYS`` keys are
remembered (the oldest is forgotten first, and may then be logged again),
keys are cut to ``MAX_KEY_CHARS``, and each argument that is not a number is
logged as at most ``MAX_ARG_CHARS`` characters of its text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["LOGGER", "MAX_ARG_CHARS", "MAX_KEYS", "LogLimiter"]

LOGGER = logging.getLogger("stabmon")
MAX_KEYS = 4096
MAX_KEY_CHARS = 256
MAX_ARG_CHARS = 500


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
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()
        # Hooks and background threads both log; the lock keeps counts exact. Re-entrant, as
        # logging's own: a signal handler that calls into stabmon may run while it is held.
        self._lock = threading.RLock()

    def once(self, key: str, level: int, message: str, *args: object) -> bool:
        """Log ``message`` the first time ``key`` is seen; return whether it was logged."""
        key = key[:MAX_KEY_CHARS]
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > MAX_KEYS:
                self._seen.popitem(last=False)
        self._logger.log(level, message, *_bounded(args))
        return True

    def limited(self, key: str, level: int, message: str, *args: object) -> bool:
        """Log ``message`` unless ``key`` was already logged ``per_minute`` times this minute."""
        now = self._clock()
        key = key[:MAX_KEY_CHARS]
        with self._lock:
            start, count = self._windows.get(key, (now, 0))
            if now - start >= 60.0:
                start, count = now, 0
            if count >= self._per_minute:
                self._windows[key] = (start, count)
                return False
            self._windows[key] = (start, count + 1)
            self._windows.move_to_end(key)
            if len(self._windows) > MAX_KEYS:
                self._windows.popitem(last=False)
        self._logger.log(level, message, *_bounded(args))
        return True


def _bounded(args: tuple[object, ...]) -> tuple[object, ...]:
    """Numbers as they are; anything else as at most ``MAX_ARG_CHARS`` of its text."""
    bounded: list[object] = []
    for arg in args:
        if isinstance(arg, (int, float)):
            bounded.append(arg)
            continue
        try:
            text = str(arg)
        except Exception:  # a hostile __str__: the type is still worth a line
            text = f"<{type(arg).__name__}>"
        if len(text) > MAX_ARG_CHARS:
            text = f"{text[:MAX_ARG_CHARS]}... ({len(text) - MAX_ARG_CHARS} more characters)"
        bounded.append(text)
    return tuple(bounded)
