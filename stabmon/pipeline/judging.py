"""The judging engine: when results read back from the device are judged, and by which thread.

Design
------
Hooks on the training thread start device-side measurements and ``submit`` their
results to a :class:`~stabmon.pipeline.readback.Readback` queue; the results are judged (handed
to ``consume``, which feeds the recorder and detectors) in batches at most
``judge_seconds`` apart on the loop clock, so the host-side work runs warm.

Results would also wait while the loop is quiet (a hang, an evaluation, a debugger),
so a judge thread calls :meth:`Judging.judge_quiet`: once neither a step end nor a
judgement has come for ``judge_seconds`` (or twice the median step, if longer), it
judges what is on the host. It never waits for the lock: a hook that holds it is a
loop that is not quiet.

One re-entrant lock (``lock``) serialises every use of the queue and of the judging
code between the threads. A call that re-enters it (a signal handler that saves a
checkpoint, a logging handler) skips its judging rather than interleave with the
judgement under way (:meth:`reentered`). Waits are bounded: the lock is waited for at
most a second and a copy in flight at most ``wait_seconds``, so neither a detach nor
the interpreter's exit can hang on a stuck device or thread.

At interpreter exit the owner calls :meth:`Judging.exit` and judges the last results;
the judge thread judges nothing after that, nor after :meth:`Judging.close` (detach). A
forked child gets a fresh lock: the parent's judge thread may have held it at the fork,
and no thread of the child would ever release it.

The engine holds its consumer weakly (a bound method,
:meth:`stabmon.pipeline.measurements.Measurements.consume`), so a Monitor dropped without
``detach()`` is still collected.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from stabmon.pipeline.readback import Readback
from stabmon.shared.guard import Guard

__all__ = ["MAX_WAITING_RESULTS", "QUIET_POLL_SECONDS", "Judging"]

#: Read-back results waiting to be judged, at most, however short the steps (bounded memory);
#: the config's judge_seconds bounds their wait in time.
MAX_WAITING_RESULTS = 512
#: How often the judge thread looks for results waiting in a quiet loop (no step end for
#: ``judge_seconds``): a hang, an evaluation without ``phase()``, a debugger.
QUIET_POLL_SECONDS = 0.25

T = TypeVar("T")
Consume = Callable[[list[tuple[T, list[float]]]], None]

#: Live engines, for the fork hook below (weakly: it keeps none alive).
_ENGINES: weakref.WeakSet[Judging[object]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for engine in list(_ENGINES):
        engine.lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX only; Windows cannot fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Judging(Generic[T]):
    """The readback queue, its lock and the rules for when waiting results are judged."""

    def __init__(
        self,
        consume: Callable[[list[tuple[T, list[float]]]], None],
        *,
        guard: Guard,
        judge_seconds: float,
    ) -> None:
        self._consume_ref = weakref.WeakMethod(consume)
        self._guard = guard
        self.readback: Readback[T] = Readback()
        self.judge_seconds = judge_seconds
        #: When results were last judged, on the loop clock (-inf: never; the first is at once).
        #: Attributes, not properties, as ``closed``: the step hooks read them every step.
        self.judged_at = -float("inf")
        #: Held around every use of the readback queue, the judging code and the sample
        #: windows: by the training thread's hooks, and by the judge thread in a quiet loop.
        self.lock = threading.RLock()
        #: Whether the Monitor detached: nothing is judged any more.
        self.closed = False
        self._exiting = False  # the exit hook: the judge thread judges no more
        _ENGINES.add(self)  # type: ignore[arg-type]  # any T: the fork hook only swaps the lock

    def close(self) -> None:
        """Detach: nothing is judged after this."""
        self.closed = True

    def exit(self) -> None:
        """The interpreter exits: the judge thread judges no more (the exit hook judges last)."""
        self._exiting = True

    def due(self, now: float, waiting: int) -> bool:
        """Whether the ``waiting`` results on the host are to be judged at ``now`` (a step
        end): ``judge_seconds`` since the last judgement, or too many waiting. Marks it."""
        if waiting and (
            now - self.judged_at >= self.judge_seconds or waiting >= MAX_WAITING_RESULTS
        ):
            self.judged_at = now
            return True
        return False

    def judge_soon(self) -> None:
        """Judge what waits at the next step end, however recent the last judgement."""
        self.judged_at = -float("inf")

    def consume(self, results: list[tuple[T, list[float]]]) -> None:
        consume = self._consume_ref()
        if consume is not None:
            consume(results)

    def reentered(self) -> bool:
        """Whether this thread is inside stabmon's judging already.

        A signal handler (SLURM's requeue checkpoint) or a logging handler may call back
        into the Monitor while it judges. Judging again there would interleave with the
        judgement under way (results out of step order, the queue read twice), so the
        caller skips its judging and goes on; what waits is judged later.
        """
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]  # RLock's own

    def judge_waiting(self, wait_seconds: float = 0.0) -> None:
        """Judge every result on the host; copies still in flight get up to ``wait_seconds``.

        Epoch ends and named phases never wait on a device; ``state_dict()``,
        ``load_state_dict()``, ``detach()`` and interpreter exit give copies in flight a
        bounded wait. The lock is held for each look, not across the wait, so a training
        thread's hooks never wait on the device through it (a checkpoint saved from another
        thread); and the lock itself is waited for at most a second (a thread stuck holding
        it must not hang a detach or the interpreter's exit).
        """
        if self.closed or self.reentered():
            return
        deadline = time.monotonic() + wait_seconds
        while self.lock.acquire(timeout=1.0):
            try:
                with self._guard.contain("readback"):
                    self.consume(self.readback.poll())
            finally:
                self.lock.release()
            if not self.readback.in_flight or time.monotonic() >= deadline:
                return
            time.sleep(0.001)

    def judge_last(self, wait_seconds: float, finish: Callable[[], None]) -> None:
        """The last judgement (detach, interpreter exit): everything waiting, with copies in
        flight given ``wait_seconds``, then ``finish`` (the device timer's last events, the
        step sample still waiting for a value) under the lock."""
        self.judge_waiting(wait_seconds)
        if self.reentered() or not self.lock.acquire(timeout=1.0):
            return
        try:
            with self._guard.contain("readback"):
                finish()
        finally:
            self.lock.release()

    def judge_quiet(self, now: float, last_beat: float, median_step: float | None) -> None:
        """Judge thread: judge the results that wait while no step ends.

        A loop that hangs, evaluates without ``phase()`` or sits in a debugger reaches no
        step end, where results are judged; the NaN that explains a hang would wait with
        it. So once neither a step end (``last_beat``) nor a judgement has come for
        ``judge_seconds``, or twice the median step if that is longer (a running loop is
        not quiet, however long its steps), this judges what is on the host. ``now`` and
        ``last_beat`` are on the loop clock.
        """
        if self.closed or self._exiting or not self.readback.pending:
            return
        quiet = max(self.judge_seconds, 2.0 * median_step) if median_step else self.judge_seconds
        if now - max(last_beat, self.judged_at) < quiet:
            return
        if not self.lock.acquire(blocking=False):
            return
        try:
            if not (self.closed or self._exiting):
                self.judged_at = now
                self.consume(self.readback.poll())
        finally:
            self.lock.release()
