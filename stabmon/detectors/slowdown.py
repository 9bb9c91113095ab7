"""Sustained slowdowns: the step time shifted up against the run's own recent baseline.

Design: the detector judges *blocks* of steps, not steps. The Monitor closes a
block at the first step end at least ``slowdown_block_seconds`` after the last
one and hands over the block's step count and the seconds each built-in phase
took in it (a block costs nothing per step: the phase counters exist anyway).
A block's mean step time is the sum of its phase seconds over its steps, so
time in named phases (``eval``, ``checkpoint``) never counts, whatever it lasts.

A block is slow when its mean step time is at least ``1 + threshold`` times the
baseline: the median mean of the normal blocks of the last ``baseline_seconds``.
Slow blocks never enter the baseline, so a slowdown cannot teach the baseline
that it is normal while it is held. A slowdown is reported once, when slow
blocks have followed each other without a normal one for ``hold_seconds`` and
for at least ``min_blocks`` blocks (one giant step is a stall, not a slowdown);
a normal block ends it, and so does time: once it has been held for
``baseline_seconds`` more, the slow pace is the run's pace now (a curriculum to
longer sequences, a bigger batch) and becomes the baseline. One slow step makes
one slow block, and the next normal block forgets it. The phase named is the one
whose seconds per step grew most against its own baseline median, in the phase
times a block carries for naming (``cause_seconds``: device time from CUDA
events, since a sync-free loop's host phases say only where the host waited),
else in its phase seconds.

Pure and host-only: no clock of its own (blocks carry their end time on the
loop clock), no threads, no torch; tests drive it with synthetic blocks.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Block", "Slowdown", "SlowdownDetector"]

#: Normal blocks kept for the baseline, at most, however short the blocks (bounded memory).
MAX_BASELINE_BLOCKS = 512


@dataclass(frozen=True)
class Block:
    """Steps between two block ends: ``end`` on the loop clock, and seconds per phase.

    ``cause_seconds``, if given, are the per-phase times used to name the phase that grew.
    """

    end: float
    steps: int
    phase_seconds: Mapping[str, float]
    cause_seconds: Mapping[str, float] | None = None

    @property
    def naming_seconds(self) -> Mapping[str, float]:
        return self.phase_seconds if self.cause_seconds is None else self.cause_seconds

    @property
    def step_seconds(self) -> float:
        return sum(self.phase_seconds.values()) / self.steps


@dataclass(frozen=True)
class Slowdown:
    """A confirmed slowdown: how much slower, since when, and which phase grew."""

    phase: str
    step_seconds: float
    baseline_seconds: float
    phase_step_seconds: float
    phase_baseline_seconds: float
    started: float
    held_seconds: float
    blocks: int

    @property
    def ratio(self) -> float:
        """Mean step time over the slow stretch against the baseline (1.2 = 20% slower)."""
        return self.step_seconds / self.baseline_seconds


@dataclass(frozen=True)
class _Normal:
    end: float
    step_seconds: float
    per_phase: dict[str, float]


class SlowdownDetector:
    """Feed :meth:`update` one :class:`Block` at a time; see the module docstring.

    Example::

        detector = SlowdownDetector(threshold=0.1, hold_seconds=300, baseline_seconds=600)
        found = detector.update(Block(end=now, steps=40, phase_seconds={"forward": 2.0}))
        if found is not None:
            print(f"{found.ratio:.2f}x slower since {found.started}, in {found.phase}")
    """

    def __init__(
        self,
        *,
        threshold: float,
        hold_seconds: float,
        baseline_seconds: float,
        min_blocks: int = 3,
        min_baseline_blocks: int = 6,
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0 (0.1 = 10% slower), got {threshold!r}")
        if not hold_seconds > 0 or not baseline_seconds > 0:
            raise ValueError(
                f"hold_seconds and baseline_seconds must be > 0, got {hold_seconds!r} and "
                f"{baseline_seconds!r}"
            )
        self._threshold = threshold
        self._hold = hold_seconds
        self._span = baseline_seconds
        self._min_blocks = max(1, min_blocks)
        self._min_baseline = max(1, min_baseline_blocks)
        self._normal: deque[_Normal] = deque(maxlen=MAX_BASELINE_BLOCKS)
        self._slow: list[Block] = []
        self._slow_since: float | None = None  # the first slow block's start
        self._last_end: float | None = None
        #: The slowdown being held, once reported; None while the run is at its baseline pace.
        self.active: Slowdown | None = None

    @property
    def baseline_seconds(self) -> float | None:
        """The baseline mean step time now, or None while too few normal blocks were seen."""
        if len(self._normal) < self._min_baseline:
            return None
        return statistics.median(normal.step_seconds for normal in self._normal)

    def reset(self) -> None:
        """Forget everything (a resume, or the loop changed shape): warm up again."""
        self._normal.clear()
        self._slow.clear()
        self._slow_since = None
        self._last_end = None
        self.active = None

    def update(self, block: Block) -> Slowdown | None:
        """Judge one block; returns a :class:`Slowdown` once per episode, when it is confirmed."""
        start = block.end if self._last_end is None else self._last_end
        self._last_end = block.end
        if block.steps <= 0:
            return None
        step_seconds = block.step_seconds
        baseline = self.baseline_seconds
        if baseline is not None and step_seconds >= baseline * (1.0 + self._threshold):
            if self._slow_since is None:
                self._slow_since = start
            self._slow.append(block)
            if len(self._slow) > MAX_BASELINE_BLOCKS:  # a long episode: keep the recent ones
                del self._slow[0]
            held = block.end - self._slow_since
            if self.active is not None and held - self.active.held_seconds >= self._span:
                self._adopt()
                return None
            if self.active is None and held >= self._hold and len(self._slow) >= self._min_blocks:
                self.active = self._confirm(baseline, held)
                return self.active
            return None
        self._slow.clear()
        self._slow_since = None
        self.active = None
        per_phase = {
            phase: seconds / block.steps for phase, seconds in block.naming_seconds.items()
        }
        self._normal.append(_Normal(block.end, step_seconds, per_phase))
        while self._normal and self._normal[0].end < block.end - self._span:
            self._normal.popleft()
        return None

    def _adopt(self) -> None:
        """The slowdown has lasted: its blocks are the baseline from now on."""
        self._normal.clear()
        for block in self._slow[-MAX_BASELINE_BLOCKS:]:
            per_phase = {phase: s / block.steps for phase, s in block.naming_seconds.items()}
            self._normal.append(_Normal(block.end, block.step_seconds, per_phase))
        self._slow.clear()
        self._slow_since = None
        self.active = None

    def _confirm(self, baseline: float, held: float) -> Slowdown:
        steps = sum(block.steps for block in self._slow)
        phases = sorted({phase for block in self._slow for phase in block.naming_seconds})
        growth: list[tuple[float, str, float, float]] = []
        for phase in phases:
            now = sum(block.naming_seconds.get(phase, 0.0) for block in self._slow) / steps
            before = statistics.median(normal.per_phase.get(phase, 0.0) for normal in self._normal)
            growth.append((now - before, phase, now, before))
        _, phase, now, before = max(growth)
        total = sum(sum(block.phase_seconds.values()) for block in self._slow)
        return Slowdown(
            phase=phase,
            step_seconds=total / steps,
            baseline_seconds=baseline,
            phase_step_seconds=now,
            phase_baseline_seconds=before,
            started=self._slow_since if self._slow_since is not None else 0.0,
            held_seconds=held,
            blocks=len(self._slow),
        )
