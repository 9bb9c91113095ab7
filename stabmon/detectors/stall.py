"""Heartbeat and stall watchdog: notices a hung run while its main thread is stuck.

Design
------
The training thread owns :class:`Heartbeat` and writes it at each step end
(``beat``) and at each loop-phase change (``phase``): plain attribute stores,
no lock. The watchdog thread only reads it. It wakes every ``poll_seconds``,
compares the time since the last beat with the current limit and reports the
edge from "running" to "stalled" and back, once each. Because it runs in its
own thread it fires while the main thread sleeps, waits in a C call that
releases the GIL (a CUDA sync, a data-loader queue) or is blocked on I/O. A C
call that holds the GIL freezes the watchdog too: that case is what the node
daemon's heartbeat age covers from outside the process.

The limit is ``stall_seconds`` when configured, else the larger of 60 s and 10
times the median of recent step times. Inside a named phase (``eval``,
``checkpoint``) and before the first step (``startup``: compilation, first
batches) the longer ``phase_stall_seconds`` applies instead, so expected long
stretches raise no false stall. So do the ranks that wait on such a stretch:
while ``peer_in_phase`` says another rank of the run is inside a named phase
within its limit (rank 0 saves a checkpoint alone, the others wait in a
barrier), the phase's limit applies to them too; it is asked once half the
rank's own limit has passed, and once the peer is past its limit (stalled
itself) the rank's own limit applies again. When the peer leaves its phase, the
waiting rank still has the next step to finish (the barrier returns, then a
whole forward and backward): its own limit counts again from the last time it
saw the peer holding, not from its last step, or every checkpoint longer than
half the limit would end in a false stall on the ranks that waited for it.
"""

from __future__ import annotations

import enum
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from stabmon.shared.heartbeat import STARTUP_PHASE, Heartbeat

__all__ = [
    "STARTUP_PHASE",
    "Heartbeat",
    "PeerPhase",
    "StallReport",
    "StallWatchdog",
    "capture_stacks",
]

#: Floor of the automatic stall limit: a minute is never a stall worth paging about.
MIN_AUTO_STALL_SECONDS = 60.0
#: The automatic limit is this many median step times.
AUTO_STALL_STEPS = 10.0


class PeerPhase(enum.Enum):
    """What the other ranks of the run say about named phases (see the module docstring)."""

    #: No peer is inside a named phase.
    NONE = "none"
    #: A peer is inside a named phase (or its start-up) within that phase's limit.
    HOLDING = "holding"
    #: A peer is past its phase's limit or has declared a stall: the job is hung.
    STALLED = "stalled"


@dataclass(frozen=True)
class StallReport:
    """What the watchdog saw when it declared a stall."""

    phase: str
    silent_seconds: float
    limit_seconds: float
    steps: int
    stacks: dict[str, list[str]]


class StallWatchdog:
    """Declares a stall when no step completes within the limit, and its end."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        *,
        stall_seconds: float | None,
        phase_stall_seconds: float,
        on_stall: Callable[[StallReport], None],
        on_recover: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
        peer_phase: Callable[[], PeerPhase] | None = None,
    ) -> None:
        self._heartbeat = heartbeat
        self._peer_phase = peer_phase
        #: When, on ``clock``, a peer was last seen holding a named phase.
        self._peer_held_at = float("-inf")
        self._stall_seconds = stall_seconds
        self._phase_stall_seconds = phase_stall_seconds
        self._on_stall = on_stall
        self._on_recover = on_recover
        self._clock = clock
        self._stalled_since: float | None = None
        self._lock = threading.Lock()

    @property
    def stalled(self) -> bool:
        return self._stalled_since is not None

    def limit_seconds(self) -> float:
        """The limit that applies now (see the module docstring)."""
        own = self._own_limit_seconds()
        if self._peer_phase is None or own >= self._phase_stall_seconds:
            return own
        now = self._clock()
        last_beat = self._heartbeat.last_beat
        silent = now - last_beat
        if silent <= own / 2:
            return own  # the peers' records are not read while a step is this recent
        # Asked from half the limit on, not only past it: a peer phase that ends before this
        # rank's own limit has passed still gives it its own limit again from there.
        peers = self._peer_phase()
        if peers is PeerPhase.HOLDING:
            self._peer_held_at = now
            return self._phase_stall_seconds if silent > own else own
        if peers is PeerPhase.NONE and self._peer_held_at > last_beat:
            return self._peer_held_at - last_beat + own  # released: its own limit from there
        return own

    def _own_limit_seconds(self) -> float:
        heartbeat = self._heartbeat
        if heartbeat.named_phase or heartbeat.steps == 0:
            return self._phase_stall_seconds
        if self._stall_seconds is not None:
            return self._stall_seconds
        median = heartbeat.median_step_seconds()
        if median is None:
            return MIN_AUTO_STALL_SECONDS
        return max(MIN_AUTO_STALL_SECONDS, AUTO_STALL_STEPS * median)

    def check(self) -> None:
        """One watchdog iteration: report a new stall or the end of one."""
        with self._lock:  # check() runs in the watchdog thread and, at detach, the caller's
            now = self._clock()
            silent = now - self._heartbeat.last_beat
            limit = self.limit_seconds()
            if self._stalled_since is None and silent > limit:
                self._stalled_since = self._heartbeat.last_beat
                report = StallReport(
                    phase=self._heartbeat.phase,
                    silent_seconds=silent,
                    limit_seconds=limit,
                    steps=self._heartbeat.steps,
                    stacks=capture_stacks(),
                )
                self._on_stall(report)
            elif (
                self._stalled_since is not None and self._heartbeat.last_beat > self._stalled_since
            ):
                lasted = self._heartbeat.last_beat - self._stalled_since
                self._stalled_since = None
                self._on_recover(lasted)


def capture_stacks(skip_current: bool = True) -> dict[str, list[str]]:
    """Python stack of every thread, keyed ``"<name> (<ident>)"``, innermost frame last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    current = threading.get_ident()
    stacks: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == current:
            continue
        label = f"{names.get(ident, 'unknown')} ({ident})"
        stacks[label] = [line.rstrip("\n") for line in traceback.format_stack(frame)]
    return stacks
