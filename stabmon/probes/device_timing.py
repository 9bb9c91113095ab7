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

Sampling
--------
Each event record, query and ``elapsed_time`` costs the host microseconds, and on a
launch-bound loop (a small model, steps of a few milliseconds) four boundaries a step were
most of stabmon's host time (issue 38). So the Monitor's timer times fast steps one in
:data:`TIMED_STEPS` (``every``; 1 times each step): a *window* records the step end before a
timed step, its boundaries and its end (five events), and the steps between windows record
nothing; the gap to the next window is drawn at random, ``every`` steps on average, so that
no periodic pattern of the loop keeps falling between windows. Each interval of a window
counts ``weight`` times, the steps the window stands for (its own and the untimed ones before),
so the phase counters still estimate all device time, and the utilization (a ratio) and the
input-starvation share are unchanged in expectation; the device step-duration histogram
observes the timed steps. When the steps between two windows took :data:`LONG_STEP_SECONDS`
or more each on the host, the boundaries cost about 1% of a step: every step is timed again.
Named phases (``eval``, ``checkpoint``) are always timed, once each (weight 1).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from stabmon.pipeline.readings import Readings

__all__ = ["LONG_STEP_SECONDS", "TIMED_STEPS", "DeviceTimer", "recorder_for"]

#: Fast steps are timed one in this many (see the module docstring).
TIMED_STEPS = 8
#: Steps this long on the host (on average between two windows) are all timed.
LONG_STEP_SECONDS = 0.05
#: The loop's own phases, timed in windows; any other phase is a named one, always timed.
_STEP_PHASES = frozenset(("data_wait", "forward", "backward", "optimizer"))


def _new_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated


def _record_on_current_stream(event: Any) -> None:
    event.record()


def recorder_for(device: torch.device) -> Callable[[Any], None]:
    """Records events on ``device``'s current stream, where the loop issues its work."""
    # Its index when it has one: current_stream() parses a device object at every call.
    where: torch.device | int = device if device.index is None else device.index

    def record(event: Any) -> None:
        event.record(torch.cuda.current_stream(where))

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
        every: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._readings = readings
        self._record = record or _record_on_current_stream
        self._max_pending = max_pending
        self._new_event = new_event
        #: Recorded boundaries: (event, the phase starting there or None when the interval
        #: from it is not timed, whether a step ended there, the weight of that interval).
        self._pending: deque[tuple[Any, str | None, bool, int]] = deque()
        self._free: list[Any] = []
        self._last_step_end: Any | None = None
        self.dropped = 0
        self._every = every
        self._clock = clock
        #: Inside a window: boundaries are recorded. The first step after attach is timed.
        self._recording = True
        #: Step ends still to pass untimed before the next window opens.
        self._countdown = 0
        #: Steps the open window stands for; the next window's, chosen when one closes.
        self._weight = self._next_weight = 1
        #: Draws the gaps between windows (seeded: a run's timing is reproducible).
        self._random = random.Random(0)
        #: The last event recorded opens no timed interval (nothing to close).
        self._gap = True
        #: When the last window closed (host clock); None before the first.
        self._closed_at: float | None = None
        #: Between windows, after the boundary that closes the last interval: a mark of the
        #: loop's own phases (not a step end) records nothing now, so the loop timer need not
        #: call :meth:`mark` for it (issue 38: three Python calls a step, seven steps in eight).
        self.idle = False

    def mark(self, phase: str, step_end: bool = False) -> None:
        """Record a boundary where ``phase`` starts; ``step_end`` after an optimizer step.

        Outside a window only named phases are recorded (and the boundary that ends one).
        """
        weight = self._weight
        timed: str | None = phase
        if not self._recording:
            if step_end:
                self._countdown -= 1
                if self._countdown > 0:
                    return
                self._recording = True  # a window opens: the next step is timed
                self._weight = weight = self._next_weight
            elif phase in _STEP_PHASES:
                if self._gap:
                    return
                timed = None  # a named phase ends outside a window: its interval closes
            else:
                weight = 1  # a named phase: timed once, whatever the window
        elif step_end and self._every > 1:
            now = self._clock()
            closed, self._closed_at = self._closed_at, now
            # The steps since the last close (the window's weight) were fast: sample. The gap
            # to the next timed step is drawn, 1 to 2 x every - 1 (every on average), so that
            # no loop pattern (a stutter every fourth batch) keeps falling between windows.
            gap = 1
            if closed is None or now - closed < self._weight * LONG_STEP_SECONDS:
                gap = self._random.randint(1, 2 * self._every - 1)
            if gap > 1:
                self._recording = False  # the timed step ends: the window closes
                self._countdown = gap - 1
                self._next_weight = gap  # the next timed step stands for the gap's steps
                timed = None
            else:
                self._weight = weight = 1  # the next step is timed too (long steps: all are)
        elif phase not in _STEP_PHASES:
            weight = 1
        event = self._free.pop() if self._free else self._new_event()
        self._record(event)
        self._pending.append((event, timed, step_end, weight))
        self._gap = gap = timed is None
        self.idle = gap and not self._recording
        if len(self._pending) > self._max_pending:
            self._recycle(self._pending.popleft()[0])
            self.dropped += 1

    def poll(self) -> None:
        """Account every interval whose closing event the device has passed; never blocks."""
        pending = self._pending
        readings = self._readings
        while len(pending) >= 2 and pending[1][0].query():
            start, phase, _, weight = pending.popleft()
            end, _, step_end, _ = pending[0]
            previous = self._last_step_end
            if phase is not None:
                seconds = start.elapsed_time(end) / 1000.0
                readings.add_device_phase_time(phase, seconds * weight if weight > 1 else seconds)
                if step_end:
                    self._step_ended(end)
            elif step_end:
                self._last_step_end = end  # a window opens: the steps before it were not timed
            self._recycle(start)
            if previous is not None and previous is not start and step_end:
                # The step end kept for the next step's duration, replaced now and out of the
                # queue already: back to the pool (a new event every window otherwise).
                self._recycle(previous)

    def _step_ended(self, event: Any) -> None:
        if self._last_step_end is not None:
            seconds = self._last_step_end.elapsed_time(event) / 1000.0
            self._readings.device_step_duration.observe(seconds)
        self._last_step_end = event

    def _recycle(self, event: Any) -> None:
        if event is not self._last_step_end and len(self._free) < 64:
            self._free.append(event)
