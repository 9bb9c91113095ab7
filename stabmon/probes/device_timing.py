"""Device-side phase and step times from CUDA events, read without waiting.

Design
------
Host timestamps say when the host reached a loop boundary; on CUDA the device
gets there later. At each boundary the loop timer calls :meth:`DeviceTimer.mark`
with the phase that starts there, which records a timing event on the current
stream (a few microseconds, no wait). The device passes the event once all work
issued before it has run, so the time between two consecutive events is the
device time of the phase between them; the gap between a step's end and the
next forward's start is the device sitting idle for input: the starved-GPU
signal that host timing cannot show.

:meth:`poll`, at each step end on the training thread, reads the intervals whose
closing event has completed (``Event.query()`` never blocks) and never waits for
the rest. Events are pooled, and at most ``max_pending`` boundaries wait; beyond
that the oldest are dropped unmeasured, so memory stays flat whatever happens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from stabmon.pipeline.readings import Readings

__all__ = ["DeviceTimer", "recorder_for"]


def _new_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated


def _record_on_current_stream(event: Any) -> None:
    event.record()


def recorder_for(device: torch.device) -> Callable[[Any], None]:
    """Records events on ``device``'s current stream, where the loop issues its work."""

    def record(event: Any) -> None:
        event.record(torch.cuda.current_stream(device))

    return record


class DeviceTimer:
    """CUDA-event timing of loop phases on one device (training thread only)."""

    def __init__(
        self,
        readings: Readings,
        *,
        record: Callable[[Any], None] | None = None,
        max_pending: int = 512,
        new_event: Callable[[], Any] = _new_event,
    ) -> None:
        self._readings = readings
        self._record = record or _record_on_current_stream
        self._max_pending = max_pending
        self._new_event = new_event
        self._pending: deque[tuple[Any, str, bool]] = deque()
        self._free: list[Any] = []
        self._last_step_end: Any | None = None
        self.dropped = 0

    def mark(self, phase: str, step_end: bool = False) -> None:
        """Record a boundary where ``phase`` starts; ``step_end`` after an optimizer step."""
        event = self._free.pop() if self._free else self._new_event()
        self._record(event)
        self._pending.append((event, phase, step_end))
        if len(self._pending) > self._max_pending:
            self._recycle(self._pending.popleft()[0])
            self.dropped += 1

    def poll(self) -> None:
        """Account every interval whose closing event the device has passed; never blocks."""
        pending = self._pending
        readings = self._readings
        while len(pending) >= 2 and pending[1][0].query():
            start, phase, _ = pending.popleft()
            end, _, step_end = pending[0]
            readings.add_device_phase_time(phase, start.elapsed_time(end) / 1000.0)
            if step_end:
                self._step_ended(end)
            self._recycle(start)

    def _step_ended(self, event: Any) -> None:
        if self._last_step_end is not None:
            seconds = self._last_step_end.elapsed_time(event) / 1000.0
            self._readings.device_step_duration.observe(seconds)
        self._last_step_end = event

    def _recycle(self, event: Any) -> None:
        if event is not self._last_step_end and len(self._free) < 64:
            self._free.append(event)
