"""Where the loop's wall time goes: phases, step duration and input wait.

The four hook boundaries (forward start and end on the root module, optimizer
step start and end; see :mod:`stabmon.wiring.hooks`) cut the loop into phases; the
time between two boundaries goes to the phase the loop was in:

    step end ──data_wait──▶ forward start ──forward──▶ forward end ──backward──▶
    optimizer start ──optimizer──▶ step end

With gradient accumulation, the stretch from one micro-batch's forward end to
the next forward start is ``backward`` (it holds the backward pass and the next
batch's fetch); only the wait before a step's first forward is ``data_wait``.
Named phases (``with mon.phase("eval")``) take all the time inside them, and
the hook boundaries they contain are ignored. A forward outside training (under
``torch.no_grad()``/``inference_mode()``, or of a model in ``eval()`` mode) outside
a named phase enters an automatic ``eval`` phase: it keeps the heartbeat alive (an
evaluation that nobody wrapped in ``mon.phase`` is no stall), its time is ``eval``
rather than ``data_wait``, and a stall inside it is reported in phase ``eval``, against the
named phases' limit (``phase_stall_seconds``) until training resumes.

The loop phase the heartbeat names (what a stall reports, ``stabmon_loop_phase``) is
``data_wait`` only while a batch is being fetched (``track()``'s ``next()``, a
``data_wait()`` block); between steps outside a fetch it is ``between_steps``: a loop
stuck in its own code after its batch arrived is not waiting for input.

These are host timestamps. On CUDA they measure when the host got there, not
when the device finished: a sync-free loop runs ahead of the device, so host
phases shift work between each other and only the step-to-step duration is
true on average. This is documented in the README's "Which figure is which".
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from stabmon.contract import BETWEEN_STEPS
from stabmon.pipeline.readings import Readings
from stabmon.shared.heartbeat import STARTUP_PHASE, Heartbeat

__all__ = ["LoopTimer", "TrackedLoader", "timed_iteration"]

T = TypeVar("T")

_DATA_WAIT = "data_wait"
_FORWARD = "forward"
_BACKWARD = "backward"
_OPTIMIZER = "optimizer"
#: The automatic phase of forwards outside training (see the module docstring).
EVAL_PHASE = "eval"


class _Busy:
    """A device mark's owner that is never idle: every boundary calls the mark."""

    idle = False


_BUSY = _Busy()


class LoopTimer:
    """Attributes host wall time to loop phases from hook boundaries (training thread only)."""

    def __init__(
        self,
        readings: Readings,
        heartbeat: Heartbeat,
        *,
        clock: Callable[[], float] = time.perf_counter,
        device_mark: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._readings = readings
        self._phases = readings.phase_seconds  # the same dict, added to at every boundary
        #: Called at each boundary with the phase starting there and whether a step just
        #: ended (CUDA-event timing), if set.
        self._device_mark = device_mark
        #: The device timer whose method ``device_mark`` is: while it is ``idle`` (between its
        #: sampling windows) the forward and optimizer boundaries do not call it (issue 38).
        owner = getattr(device_mark, "__self__", None)
        self._device: Any = owner if isinstance(getattr(owner, "idle", None), bool) else _BUSY
        self._heartbeat = heartbeat
        # Also the heartbeat's clock: its beats are this clock's readings (one read a step).
        self._clock = clock
        #: The loop clock, for callers that keep time with the boundaries' readings.
        self.clock = clock
        self._state = _DATA_WAIT
        self._mark = clock()
        #: Input wait timed by ``track()`` since ``_mark``: all that is known of a compiled forward.
        self._loader_seconds = 0.0
        self._last_step_end: float | None = None
        self._named: list[str] = []
        # Set once ``track()`` measures input wait itself; the hook figure is then not observed.
        self._loader_tracked = False
        #: True from the first forward of an iteration until its optimizer step.
        self.in_iteration = False
        #: The last iteration ended without a step (GradScaler skipped it): a loss observed
        #: now is that iteration's, whose index is the step still in progress.
        self.iteration_was_skipped = False
        #: Whether a training forward was ever seen; never, when the forward runs compiled.
        self.forward_seen = False
        #: Inside ``mon.phase(...)``: an attribute, not a property, for observe() on every step.
        self.in_named_phase = False
        #: The heartbeat's phase before the fetch in progress, put back when it ends.
        self._before_fetch: str | None = None
        #: Inside ``optimizer.step()``: a forward there is a closure pass (LBFGS).
        self._in_step = False
        #: The last step's duration on the loop clock (inf before the second step end): a
        #: fast step's loss may wait for the next step's read-back event (issue 38).
        self.last_step_seconds = float("inf")

    @property
    def phase(self) -> str:
        return self._named[-1] if self._named else self._state

    def track_loader(self) -> None:
        """From now on input wait is timed around the loader's ``next()`` (``track()``)."""
        self._loader_tracked = True
        self._readings.input_wait_measured = True

    # The four boundaries below run every step: they add to ``phase_seconds`` in place rather
    # than through ``Readings.add_phase_time``, and enter the next phase inline rather than
    # through ``_enter``, one Python call fewer each.

    def forward_start(self) -> None:
        if self._named:
            return
        now = self._clock()
        elapsed = now - self._mark
        state = self._state
        if state == _DATA_WAIT:
            if not self._loader_tracked and self._last_step_end is not None:
                self._readings.data_wait.observe(elapsed)
            self.in_iteration = True
            self.iteration_was_skipped = False
        elif state == EVAL_PHASE:
            self.in_iteration = True  # training resumes after an evaluation
            self._heartbeat.named_phase = False  # and the step's limit with it
        elif self._in_step:
            # A closure pass inside step(closure) (LBFGS): progress, and the step in progress
            # is what a loss observed in the closure belongs to.
            self._heartbeat.progress(now)
            self.in_iteration = True
        self.forward_seen = True
        phases = self._phases
        phases[state] = phases.get(state, 0.0) + elapsed
        self._state = self._heartbeat.phase = _FORWARD
        self._mark = now
        self._loader_seconds = 0.0
        if self._device_mark is not None and not self._device.idle:
            self._device_mark(_FORWARD, False)

    def eval_forward(self) -> None:
        """A forward outside training and outside named phases: the automatic ``eval`` phase.

        Each one is progress for the heartbeat, so an unwrapped evaluation is no stall.
        """
        if self._named:
            return
        now = self._clock()
        if self._state != EVAL_PHASE:
            phases = self._phases
            phases[self._state] = phases.get(self._state, 0.0) + (now - self._mark)
            self._mark = now
            self._loader_seconds = 0.0
            self._state = self._heartbeat.phase = EVAL_PHASE
            self._heartbeat.named_phase = True  # an evaluation has the named phases' limit
            if self._device_mark is not None:
                self._device_mark(EVAL_PHASE, False)
        self._heartbeat.progress(now)

    def forward_end(self) -> None:
        if self._named:
            return
        now = self._clock()
        state = self._state
        phases = self._phases
        phases[state] = phases.get(state, 0.0) + (now - self._mark)
        self._state = self._heartbeat.phase = _BACKWARD
        self._mark = now
        self._loader_seconds = 0.0
        if self._device_mark is not None and not self._device.idle:
            self._device_mark(_BACKWARD, False)

    def optimizer_start(self) -> None:
        if self._named:
            return
        now = self._clock()
        elapsed = now - self._mark
        if self._state == _DATA_WAIT:
            # No forward boundary since the last step: the forward ran compiled, where the hooks
            # are no-ops (stabmon.wiring.hooks). Only track()'s loader time is known input wait; the
            # rest is forward and backward, which cannot be told apart.
            waited = min(self._loader_seconds, elapsed)
            self._readings.add_phase_time(_DATA_WAIT, waited)
            self._readings.add_phase_time(_FORWARD, elapsed - waited)
        else:
            phases = self._phases
            phases[self._state] = phases.get(self._state, 0.0) + elapsed
        self._state = self._heartbeat.phase = _OPTIMIZER
        self._heartbeat.named_phase = False  # an evaluation before step(closure) is over
        self._in_step = True
        self._mark = now
        self._loader_seconds = 0.0
        if self._device_mark is not None and not self._device.idle:
            self._device_mark(_OPTIMIZER, False)

    def optimizer_end(self) -> float:
        """A step completed: count it, beat the heartbeat, start the next data wait.

        Returns the step's end on the loop clock (one clock read serves the caller too).
        """
        now = self._clock()
        readings = self._readings
        named = self._named
        if not named:
            phases = self._phases
            phases[self._state] = phases.get(self._state, 0.0) + (now - self._mark)
        last = self._last_step_end
        step_seconds = None if last is None else now - last
        if step_seconds is not None:
            readings.step_duration.observe(step_seconds)
            self.last_step_seconds = step_seconds
        self._last_step_end = now
        readings.steps += 1
        readings.last_step_unix = time.time()
        self._heartbeat.beat(now, step_seconds)
        self.in_iteration = False
        self.iteration_was_skipped = False
        self._in_step = False
        if not named:
            self._state = _DATA_WAIT
            self._heartbeat.phase = BETWEEN_STEPS
            self._heartbeat.named_phase = False
            self._mark = now
            self._loader_seconds = 0.0
            if self._device_mark is not None:
                self._device_mark(_DATA_WAIT, True)
        return now

    def fetch_start(self) -> None:
        """A batch fetch begins (``track()``'s ``next()``, ``data_wait()``): the loop waits
        for input until :meth:`loader_wait` ends it."""
        if self._named or self._state == EVAL_PHASE:
            return  # a validation loader is part of its evaluation
        heartbeat = self._heartbeat
        if heartbeat.phase != _DATA_WAIT:
            self._before_fetch = heartbeat.phase
            heartbeat.phase = _DATA_WAIT

    def fetch_over(self) -> None:
        """The fetch in progress ended without a batch (the loader's end, an error): the loop
        is back in its own code. :meth:`loader_wait` does this for a fetched batch."""
        before, self._before_fetch = self._before_fetch, None
        if before is not None and self._heartbeat.phase == _DATA_WAIT:
            self._heartbeat.phase = before

    def loader_wait(self, seconds: float) -> None:
        """Input wait measured around a batch fetch (``track()``'s ``next()``, ``data_wait()``).

        A fetch in the middle of an iteration (the next micro-batch, fetched between
        forward and backward) is taken out of the phase it interrupted and booked as
        ``data_wait``: input starvation is never counted as backward.
        """
        if self._named:  # a validation loader inside mon.phase("eval") is not input wait
            return
        if self._before_fetch is not None:
            self.fetch_over()
        self._readings.data_wait.observe(seconds)
        state = self._state
        if state == _DATA_WAIT:
            self._loader_seconds += seconds
        elif state != EVAL_PHASE:
            phases = self._phases
            phases[_DATA_WAIT] = phases.get(_DATA_WAIT, 0.0) + seconds
            self._mark += seconds  # the interrupted phase resumes after the fetch

    def iteration_skipped(self) -> None:
        """The optimizer step was skipped (GradScaler): end the iteration without a step."""
        if self._named:
            return
        now = self._clock()
        self._readings.add_phase_time(self._state, now - self._mark)
        self.in_iteration = False
        self.iteration_was_skipped = True
        self._in_step = False
        self._heartbeat.named_phase = False
        self._enter(_DATA_WAIT, now)

    def enter_named(self, name: str) -> None:
        now = self._clock()
        if self._named:
            self._readings.add_phase_time(self._named[-1], now - self._mark)
        else:
            self._readings.add_phase_time(self._state, now - self._mark)
        self._named.append(name)
        self.in_named_phase = True
        self._mark = now
        self._loader_seconds = 0.0
        self._heartbeat.progress(now)
        if self._device_mark is not None:
            self._device_mark(name, False)
        self._heartbeat.phase = name
        self._heartbeat.named_phase = True

    def exit_named(self) -> None:
        now = self._clock()
        if self._named:
            self._readings.add_phase_time(self._named.pop(), now - self._mark)
        self.in_named_phase = bool(self._named)
        self._mark = now
        self._loader_seconds = 0.0
        self._heartbeat.progress(now)  # silence is measured from the phase's end
        if self._device_mark is not None:
            self._device_mark(self._named[-1] if self._named else _DATA_WAIT, False)
        if self._named:
            self._heartbeat.phase = self._named[-1]
        else:
            self._heartbeat.named_phase = False
            # Back in the loop: whatever comes next (a batch fetch, usually) is booked as input
            # wait; the loop is in its own code until a fetch begins.
            self._state = _DATA_WAIT
            self._heartbeat.phase = self._idle_phase()

    def _idle_phase(self) -> str:
        """The heartbeat's phase between steps: ``startup`` before the first one."""
        return BETWEEN_STEPS if self._heartbeat.steps else STARTUP_PHASE

    def _enter(self, state: str, now: float) -> None:
        """Enter ``state`` at ``now``; the per-step boundaries above do the same inline."""
        self._state = state
        self._mark = now
        self._loader_seconds = 0.0
        self._before_fetch = None
        self._heartbeat.phase = self._idle_phase() if state == _DATA_WAIT else state
        if self._device_mark is not None:
            self._device_mark(state, False)


class TrackedLoader(Generic[T]):
    """What ``Monitor.track(loader)`` returns: iterates as the loader does, timing each fetch.

    ``len()`` and attribute access are the loader's (``tracked.dataset``,
    ``tracked.sampler.set_epoch(epoch)``); each ``iter()`` is a new timed pass, except
    that a pass begun with ``next()`` is continued by the next ``iter()``, as a generator is.
    """

    def __init__(self, loader: Iterable[T], start: Callable[[], Iterator[T]]) -> None:
        self._loader = loader
        self._start = start
        self._current: Iterator[T] | None = None
        # The latest pass, weakly: close() can end it, and a loop left early still frees it.
        self._latest: weakref.ref[Iterator[T]] | None = None

    def __iter__(self) -> Iterator[T]:
        current = self._current
        if current is not None:  # a pass begun with next(): the for loop continues it
            self._current = None
            return current
        return self._begin()

    def __next__(self) -> T:  # next(mon.track(loader)) without a for loop
        if self._current is None:
            self._current = self._begin()
        return next(self._current)

    def close(self) -> None:
        """End the latest pass, as ``close()`` on a generator does: the loader's iterator
        (and its worker processes) is released now rather than at garbage collection."""
        self._current = None
        latest = None if self._latest is None else self._latest()
        close = getattr(latest, "close", None)
        if close is not None:
            close()

    def _begin(self) -> Iterator[T]:
        iterator = self._start()
        try:
            self._latest = weakref.ref(iterator)
        except TypeError:  # an iterator that takes no weak reference cannot be closed here
            self._latest = None
        return iterator

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]  # a TypeError, as len(loader) gives

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("_loader")
        if loader is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(loader, name)


def timed_iteration(
    iterable: Iterable[T],
    on_wait: Callable[[float], None],
    on_exhausted: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    on_iterator: Callable[[Iterator[T]], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    on_fetch: Callable[[], None] | None = None,
) -> Iterator[T]:
    """Yield from ``iterable``, timing each ``next()``; call ``on_exhausted`` at its end.

    ``on_iterator`` sees the iterator once; ``on_error`` sees an exception from
    ``next()`` before it propagates (it must not raise); ``on_fetch`` is called before
    each ``next()`` (it must not raise either).
    """
    iterator = iter(iterable)
    if on_iterator is not None:
        on_iterator(iterator)
    while True:
        if on_fetch is not None:
            on_fetch()
        start = clock()
        try:
            item = next(iterator)
        except StopIteration:
            break
        except Exception as error:
            if on_error is not None:
                on_error(error)
            raise
        on_wait(clock() - start)
        yield item
    on_exhausted()
