"""The training loop's heartbeat: the last progress, written by the training thread only.

The training thread writes it (plain attribute stores, no lock) and the stall watchdog
(:mod:`stabmon.detectors.stall`) reads it from its own thread; it measures, the
watchdog judges.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["STARTUP_PHASE", "Heartbeat"]

#: Phase reported before the first forward (compilation, first batches).
STARTUP_PHASE = "startup"
_RING = 64


class Heartbeat:
    """Last progress of the training loop; written by the training thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: Last progress, on ``clock``: a step end, or a named phase's start or end.
        self.last_beat: float = clock()
        self.phase: str = STARTUP_PHASE
        self.named_phase: bool = False
        #: Steps completed in this process (a resumed run has a start-up again).
        self.steps = 0
        self._durations: list[float] = []
        self._cursor = 0

    def beat(self, now: float, step_seconds: float | None) -> None:
        """A step completed at ``now`` (on ``clock``), ``step_seconds`` after the previous one."""
        self.last_beat = now
        self.steps += 1
        if step_seconds is not None:
            if len(self._durations) < _RING:
                self._durations.append(step_seconds)
            else:
                self._durations[self._cursor] = step_seconds
                self._cursor = (self._cursor + 1) % _RING

    def progress(self, now: float) -> None:
        """Progress that is not a step (a named phase began or ended): restart the silence."""
        self.last_beat = now

    def median_step_seconds(self) -> float | None:
        durations = list(self._durations)  # one atomic copy; the training thread goes on
        return statistics.median(durations) if durations else None
