"""Input starvation: the loop waits on its input for a large share of its training time.

Design: the plug-in judges *blocks* of steps, as the slowdown rule does. At the first step
end at least ``window_seconds / BLOCKS`` of training time after the last block (the
``step_end`` port, whose ``next_step`` is placed from the median step time, so nothing
runs in between), a block is closed with the input wait it holds and the training time it
took: the built-in phases only (``data_wait``, ``forward``, ``backward``, ``optimizer``),
so an evaluation or a checkpoint (a named phase) is neither wait nor time. On CUDA the
wait is the device's idle time waiting for input, from the CUDA events stabmon records
(``stabmon_device_phase_seconds_total{phase="data_wait"}``): a sync-free loop's host may
wait for a batch while the device still works through queued steps, which is no
starvation. Elsewhere it is the host's ``data_wait``, and only where that is measured around
the fetches (``track()``, ``data_wait()``): in a loop that does neither (a trainer whose
loader stabmon does not see) it is all the time between a step's end and the next forward,
the trainer's own work included, which is no evidence of waiting on input.

The share is judged over the blocks of the last ``window_seconds`` of training time (the
loop clock's, so a test can compress hours): an episode starts when the window is full
and its share reaches ``share`` (one ``input_starvation`` anomaly), and ends when the
share falls below half of it (one ``input_starvation_end`` record with the episode's first
and last step, length and mean share). A steady small wait (a loader a little slower than
half the step) never reaches the share; a stutter (every few steps a long wait for a
starved worker pool) does, within a window and a block of its start.

Pure judgement in :class:`StarvationDetector` (host floats, no clock of its own); the
plug-in :class:`InputStarvation` reads the phase counters and publishes
``stabmon_input_starvation_active``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stabmon.contract import INPUT_STARVATION_ACTIVE, PHASES

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["BLOCKS", "Episode", "InputStarvation", "StarvationDetector"]

#: Blocks per window: the window's share moves by at most 1/BLOCKS of it per block.
BLOCKS = 6
#: Most steps between two looks at the phase counters: a loop whose steps slow down (the
#: stutter itself) would otherwise close its block long after the median step time says.
MAX_BLOCK_STEPS = 50
#: Steps completed before the first block opens: start-up (the loader's workers starting,
#: the first batches, compilation) is not starvation.
WARMUP_STEPS = 5
_DATA_WAIT = "data_wait"


@dataclass(frozen=True)
class Episode:
    """A starvation episode: when it began (loop clock) and its share so far."""

    started: float
    share: float
    blocks: int


class StarvationDetector:
    """Feed :meth:`update` one block at a time; see the module docstring.

    Example::

        detector = StarvationDetector(share=0.3, window_seconds=30.0)
        began, ended = detector.update(end=now, wait=4.0, seconds=5.0)
        if began is not None:
            print(f"waiting on input {began.share:.0%} of the time since {began.started}")
    """

    def __init__(self, *, share: float, window_seconds: float) -> None:
        if not 0 < share < 1:
            raise ValueError(f"share must be between 0 and 1 (0.3 = 30%), got {share!r}")
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds!r}")
        self._share = share
        self._window = window_seconds
        self._blocks: deque[tuple[float, float, float]] = deque()  # (end, wait, seconds)
        self._held = 0.0  # training seconds in the window
        self._waited = 0.0
        #: The episode in progress, if any.
        self.active: Episode | None = None
        self._episode_wait = self._episode_seconds = 0.0

    @property
    def share(self) -> float | None:
        """The window's input-wait share (None before it holds any training time)."""
        return self._waited / self._held if self._held > 0 else None

    def update(
        self, *, end: float, wait: float, seconds: float
    ) -> tuple[Episode | None, Episode | None]:
        """One block: ``wait`` seconds of input wait in ``seconds`` of training time, ended
        at ``end``. Returns (the episode that began here, the episode that ended here)."""
        if not seconds > 0:
            return None, None
        wait = min(max(wait, 0.0), seconds)
        self._blocks.append((end, wait, seconds))
        self._held += seconds
        self._waited += wait
        while len(self._blocks) > 1 and self._held - self._blocks[0][2] >= self._window:
            _, old_wait, old_seconds = self._blocks.popleft()
            self._held -= old_seconds
            self._waited -= old_wait
        share = self._waited / self._held
        active = self.active
        if active is not None:
            self._episode_wait += wait
            self._episode_seconds += seconds
            if share < self._share / 2:
                self.active = None
                mean = self._episode_wait / self._episode_seconds
                return None, Episode(active.started, mean, active.blocks + 1)
            self.active = Episode(active.started, active.share, active.blocks + 1)
            return None, None
        if self._held >= self._window * (1 - 1 / BLOCKS) and share >= self._share:
            started = self._blocks[0][0] - self._blocks[0][2]  # the window's start
            self.active = Episode(started, share, 1)
            self._episode_wait, self._episode_seconds = self._waited, self._held
            return self.active, None
        return None, None

    def reset(self) -> None:
        self._blocks.clear()
        self._held = self._waited = 0.0
        self.active = None


class InputStarvation:
    """Plug-in: ``input_starvation`` anomalies and ``stabmon_input_starvation_active``."""

    component = "detectors"

    def __init__(self, context: Context) -> None:
        config = context.config.throughput
        self._context = context
        self._readings = context.readings
        self._heartbeat = context.heartbeat
        self._share = config.starvation_share
        self._block = config.starvation_window_seconds / BLOCKS
        self._detector = StarvationDetector(
            share=config.starvation_share, window_seconds=config.starvation_window_seconds
        )
        self._mark: tuple[int, dict[str, float], dict[str, float]] | None = None
        self._first_step: int | None = None
        self._device_used = False
        #: Called at the step end where ``steps`` (completed) reaches this.
        self.next_step = WARMUP_STEPS if config.starvation_share < 1 else 2**62

    def step_end(self, steps: int) -> None:
        host = _phases(self._readings.phase_seconds)
        device = _phases(self._readings.device_phase_seconds)
        mark, self._mark = self._mark, (steps, host, device)
        if mark is None:  # the first block opens after the warm-up
            self.next_step = steps + self._steps_per_block()
            return
        _, host_before, device_before = mark
        seconds = sum(host.values()) - sum(host_before.values())
        wait = host[_DATA_WAIT] - host_before[_DATA_WAIT]
        device_seconds = sum(device.values()) - sum(device_before.values())
        if device_seconds > 0:  # CUDA events: the device's idle time for input is the truth
            self._device_used = True
            wait = (device[_DATA_WAIT] - device_before[_DATA_WAIT]) / device_seconds * seconds
        elif not self._readings.input_wait_measured:
            self._mark = None  # no fetch is timed: nothing to judge (and no stale block)
            self.next_step = steps + MAX_BLOCK_STEPS
            return
        if seconds < self._block:  # short of a block (the estimate was off): wait for more
            self._mark = mark
            self.next_step = steps + max(1, self._steps_per_block(seconds - self._block))
            return
        self.next_step = steps + self._steps_per_block()
        with self._context.judging():
            self._judge(self._heartbeat.last_beat, wait, seconds)

    def _judge(self, end: float, wait: float, seconds: float) -> None:
        began, ended = self._detector.update(end=end, wait=wait, seconds=seconds)
        step = self._context.last_step
        where = "the device waited idle" if self._device_used else "the loop waited"
        if began is not None:
            self._first_step = step
            window = self._detector.share or began.share
            self._context.anomaly(
                "input_starvation",
                step,
                f"input starvation: {where} for input {window:.0%} of its training time over "
                f"the last {self._detector_window():.0f} s (threshold {self._share:.0%}), at "
                f"step {step}; the loader cannot keep up: raise DataLoader num_workers, "
                "prefetch_factor or pin_memory, use persistent_workers=True, move decoding and "
                "augmentation off the training process, or read from faster storage",
                share=round(window, 4),
                threshold=self._share,
                window_seconds=self._detector_window(),
                device_time=self._device_used,
            )
        if ended is not None:
            self._context.event(
                "input_starvation_end",
                step=step,
                first_step=self._first_step,
                lasted_seconds=round(end - ended.started, 3),
                share=round(ended.share, 4),
            )
            self._first_step = None

    def _detector_window(self) -> float:
        return float(self._block * BLOCKS)

    def _steps_per_block(self, seconds: float | None = None) -> int:
        median = self._heartbeat.median_step_seconds()
        wanted = self._block if seconds is None else abs(seconds)
        if not median or median <= 0:
            return 1
        return max(1, min(MAX_BLOCK_STEPS, int(wanted / median)))

    def readings(self) -> Iterable[tuple[Any, Iterable[tuple[tuple[str, ...], float]]]]:
        yield INPUT_STARVATION_ACTIVE, [((), 1.0 if self._detector.active else 0.0)]

    def finish(self) -> None:
        """The last judgement: an episode still open ends with the run."""
        active = self._detector.active
        if active is None:
            return
        self._context.event(
            "input_starvation_end",
            step=self._context.last_step,
            first_step=self._first_step,
            lasted_seconds=round(self._heartbeat.last_beat - active.started, 3),
            share=round(self._detector.share or active.share, 4),
            open=True,
        )
        self._detector.reset()


def _phases(seconds: Mapping[str, float]) -> dict[str, float]:
    """The built-in training phases' seconds (named phases are not training time)."""
    return {phase: seconds.get(phase, 0.0) for phase in PHASES}
