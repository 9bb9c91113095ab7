"""Memory drift against a baseline epoch, and the consecutive-growing-windows leak rule.

One memory sample per epoch end is compared with two references:

- the *baseline*, the first sample after ``warmup_epochs`` (start-up allocations, caches
  and allocator pools settle during warm-up), giving ``drift`` for dashboards;
- the start of the current window of ``window_epochs`` epochs. When a window closes,
  its relative growth is checked against ``threshold``; a leak is suspected after
  ``windows`` consecutive windows each grew by more than that.

Requiring consecutive growing windows, rather than total drift, separates a leak (growth
that never stops) from an allocator that grows once to its working set and stays there.
Windows are measured in epoch numbers, not samples, so a skipped epoch does not stretch
a window.

    detector = LeakDetector(threshold=0.03, windows=3, window_epochs=10, warmup_epochs=2)
    verdict = detector.update(epoch, torch.cuda.memory_reserved())
    if verdict.newly_suspected:
        print(f"memory grew >3% in 3 windows of 10 epochs; drift {verdict.drift:.1%}")
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = ["LeakDetector", "LeakVerdict"]

_STATE_KEYS = frozenset({"baseline", "window_start_epoch", "window_start_value", "growing_windows"})


@dataclass(frozen=True)
class LeakVerdict:
    """What one memory sample says about a leak."""

    drift: float | None
    """(value - baseline) / baseline; None before the baseline, when the baseline is 0,
    or when the sample was ignored."""
    window_growth: float | None
    """Relative growth over the window that closed at this sample, else None."""
    growing_windows: int
    """Consecutive closed windows whose growth exceeded the threshold."""
    suspected: bool
    """growing_windows >= windows."""
    newly_suspected: bool
    """Suspected now and not at the previous update: alert on this one."""


class LeakDetector:
    """Tracks memory samples taken at epoch ends; one :meth:`update` per sample.

    A window starts at the baseline sample and closes at the first sample whose epoch is
    at least ``window_epochs`` past the window's start; that sample starts the next one.
    State is a handful of numbers, saved by :meth:`state_dict` so that a resumed run
    keeps its baseline and its window progress.
    """

    def __init__(
        self, *, threshold: float, windows: int, window_epochs: int, warmup_epochs: int
    ) -> None:
        if not threshold > 0:
            raise ValueError(
                f"LeakDetector threshold must be a relative growth > 0 (for example 0.03 "
                f"for 3%), got {threshold!r}"
            )
        if windows < 1:
            raise ValueError(
                f"LeakDetector windows must be a number of consecutive windows >= 1, "
                f"got {windows!r}"
            )
        if window_epochs < 1:
            raise ValueError(
                f"LeakDetector window_epochs must be a number of epochs >= 1, got {window_epochs!r}"
            )
        if warmup_epochs < 0:
            raise ValueError(
                f"LeakDetector warmup_epochs must be a number of epochs >= 0, got {warmup_epochs!r}"
            )
        self._threshold = threshold
        self._windows = windows
        self._window_epochs = window_epochs
        self._warmup_epochs = warmup_epochs
        self._baseline: float | None = None
        # The window fields mean something only once the baseline is set.
        self._window_start_epoch = 0
        self._window_start_value = 0.0
        self._growing_windows = 0

    @property
    def baseline(self) -> float | None:
        """The memory sampled at the baseline epoch, or None while still warming up."""
        return self._baseline

    def update(self, epoch: int, value: float) -> LeakVerdict:
        """Take the memory ``value`` (bytes) sampled at the end of ``epoch`` (0-based).

        Samples from warm-up epochs, and non-finite or negative values, are ignored: the
        verdict then carries no drift and the state does not change.
        """
        previously_suspected = self._suspected()
        if epoch < self._warmup_epochs or not math.isfinite(value) or value < 0:
            return self._verdict(None, None, previously_suspected)
        value = float(value)
        if self._baseline is None:
            self._baseline = value
            self._window_start_epoch = epoch
            self._window_start_value = value
        if self._baseline == 0:
            # A device that held nothing at the baseline cannot leak by ratio.
            return self._verdict(None, None, previously_suspected)
        drift = (value - self._baseline) / self._baseline
        window_growth = None
        if epoch >= self._window_start_epoch + self._window_epochs:
            window_growth = self._close_window(epoch, value)
        return self._verdict(drift, window_growth, previously_suspected)

    def state_dict(self) -> dict[str, float | int | None]:
        """The baseline and window progress, as JSON-able values; see :meth:`load_state_dict`."""
        return {
            "baseline": self._baseline,
            "window_start_epoch": self._window_start_epoch,
            "window_start_value": self._window_start_value,
            "growing_windows": self._growing_windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state saved by :meth:`state_dict`.

        Raises ValueError, and leaves the detector unchanged, when ``state`` is malformed.
        """
        if set(state) != _STATE_KEYS:
            raise ValueError(
                f"LeakDetector state must have exactly the keys {sorted(_STATE_KEYS)} "
                f"(as saved by state_dict()), got {sorted(state)}"
            )
        baseline = state["baseline"]
        start_epoch = state["window_start_epoch"]
        start_value = state["window_start_value"]
        growing = state["growing_windows"]
        if baseline is not None and not (_is_finite_number(baseline) and baseline >= 0):
            raise ValueError(
                f"LeakDetector state 'baseline' must be None or a finite number >= 0, "
                f"got {baseline!r}"
            )
        if not _is_int(start_epoch):
            raise ValueError(
                f"LeakDetector state 'window_start_epoch' must be an integer, got {start_epoch!r}"
            )
        if not (_is_finite_number(start_value) and start_value >= 0):
            raise ValueError(
                f"LeakDetector state 'window_start_value' must be a finite number >= 0, "
                f"got {start_value!r}"
            )
        if not (_is_int(growing) and growing >= 0):
            raise ValueError(
                f"LeakDetector state 'growing_windows' must be an integer >= 0, got {growing!r}"
            )
        self._baseline = None if baseline is None else float(baseline)
        self._window_start_epoch = start_epoch
        self._window_start_value = float(start_value)
        self._growing_windows = growing

    def _close_window(self, epoch: int, value: float) -> float | None:
        start = self._window_start_value
        # A window that started at 0 bytes has no relative growth; it breaks the run.
        growth = (value - start) / start if start > 0 else None
        if growth is not None and growth > self._threshold:
            self._growing_windows += 1
        else:
            self._growing_windows = 0
        self._window_start_epoch = epoch
        self._window_start_value = value
        return growth

    def _suspected(self) -> bool:
        return self._growing_windows >= self._windows

    def _verdict(
        self, drift: float | None, window_growth: float | None, previously_suspected: bool
    ) -> LeakVerdict:
        suspected = self._suspected()
        return LeakVerdict(
            drift=drift,
            window_growth=window_growth,
            growing_windows=self._growing_windows,
            suspected=suspected,
            newly_suspected=suspected and not previously_suspected,
        )


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True is no epoch.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
