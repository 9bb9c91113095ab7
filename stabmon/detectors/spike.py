"""Robust online z-score for loss and gradient-norm spikes.

Each value is compared with an exponentially weighted (EW) mean and variance of the
values before it, and a value more than ``threshold`` standard deviations *above* the
mean is a spike. An EW mean follows a loss curve that falls over training, where a
global mean would be meaningless and a fixed window would cost memory. Three details
keep the z-score honest:

- warm-up: the first ``warmup`` values feed a plain running mean and variance (an EW
  mean started from one value is badly biased) and are never judged;
- clamping: a judged value enters the statistics clamped to ``mean ± threshold·std``,
  so one spike barely moves them and the next spike is still seen, while a genuine
  level shift is still followed, gradually;
- a standard-deviation floor, so a perfectly flat series (a constant loss) does not
  turn a rounding wiggle into a huge z-score;
- a floor on the size of the rise itself: a value must also exceed the mean by
  ``min_delta`` (absolute, in the original space) and by the factor ``min_ratio``.
  A converged loss of 1e-5 whose float noise is a 6-sigma event is still 1e-5, and a
  tiny model's gradient norm that doubles is no incident: z-scores alone page on both;
- episodes: spikes that follow each other within ``episode_gap`` values are one
  incident (``run_length`` counts on), so a blow-up that spikes on and off is
  reported once.

With ``log_scale=True`` (gradient norms, which vary multiplicatively) all of this runs
on ``log(value)``, so the z-score measures a ratio rather than a difference.

    detector = SpikeDetector(threshold=6.0, warmup=100, alpha=0.01)
    for step, loss in enumerate(losses):
        if (spike := detector.update(loss)) is not None:
            print(f"step {step}: {spike.value:.3g} is {spike.zscore:.1f} sd above {spike.mean:.3g}")
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard

__all__ = ["ABS_STD_FLOOR", "REL_STD_FLOOR", "Spike", "SpikeDetector"]

# A 0.1% move of a flat series is noise, not a spike; floats carry ~16 digits anyway.
REL_STD_FLOOR = 1e-3
# Keeps the z-score finite for a series that sits at exactly zero.
ABS_STD_FLOOR = 1e-12

_INF = math.inf
_STATE_KEYS = frozenset({"count", "mean", "var"})


@dataclass(frozen=True)
class Spike:
    """A value that rose more than ``threshold`` standard deviations above the mean."""

    value: float
    """The observed value, as passed to :meth:`SpikeDetector.update`."""
    zscore: float
    """Standard deviations above the running mean, in the detector's (log or linear) space."""
    mean: float
    """Running mean before this value, in the original space (a geometric mean when log_scale)."""
    run_length: int = 1
    """Consecutive spiking values up to this one; 1 starts a new episode (one incident)."""


class SpikeDetector:
    """Flags upward spikes in a stream of floats, one :meth:`update` per value.

    The detector holds no clock and no history: three numbers of state, saved by
    :meth:`state_dict` so that a resumed run continues its statistics.

        detector = SpikeDetector(threshold=6.0, warmup=100, alpha=0.01, log_scale=True)
        spike = detector.update(grad_norm)  # a Spike, or None
    """

    def __init__(
        self,
        *,
        threshold: float,
        warmup: int,
        alpha: float,
        log_scale: bool = False,
        min_delta: float = 0.0,
        min_ratio: float = 1.0,
        episode_gap: int = 1,
    ) -> None:
        if not threshold > 0:
            raise ValueError(
                f"SpikeDetector threshold must be a z-score > 0 (for example 6.0), "
                f"got {threshold!r}"
            )
        if warmup < 1:
            raise ValueError(
                f"SpikeDetector warmup must be a number of values >= 1 (for example 100), "
                f"got {warmup!r}"
            )
        if not 0 < alpha < 1:
            raise ValueError(
                f"SpikeDetector alpha must be an EMA weight in (0, 1) (for example 0.01), "
                f"got {alpha!r}"
            )
        if not (min_delta >= 0 and min_ratio >= 1 and episode_gap >= 1):
            raise ValueError(
                f"SpikeDetector needs min_delta >= 0, min_ratio >= 1 and episode_gap >= 1 "
                f"(for example 1e-3, 1.1, 20), got {min_delta!r}, {min_ratio!r}, {episode_gap!r}"
            )
        self._min_delta = min_delta
        self._min_ratio = min_ratio
        self._episode_gap = episode_gap
        # Values since the last spike: an episode ends after episode_gap quiet values.
        self._quiet = 0
        self._threshold = threshold
        self._warmup = warmup
        self._alpha = alpha
        self._log_scale = log_scale
        self._count = 0
        self._mean = 0.0
        self._var = 0.0
        # Not part of state_dict: a resume in the middle of a spike starts a new episode.
        self._run = 0

    @property
    def count(self) -> int:
        """Values taken into the statistics: the finite ones (and positive, when log_scale)."""
        return self._count

    def update(self, value: float) -> Spike | None:
        """Judge ``value`` against the values before it, then add it to the statistics.

        Returns a :class:`Spike` when ``value`` is more than ``threshold`` standard
        deviations above the mean, else None. Non-finite values (and values <= 0 when
        log_scale) are ignored: the state does not change and the result is None.
        """
        if self._log_scale:
            if not 0.0 < value < _INF:  # NaN fails every comparison
                return None
            x = math.log(value)
        elif -_INF < value < _INF:
            x = value
        else:
            return None
        # Comparisons and locals rather than max() and attribute round trips: this runs for
        # every loss and every gradient norm.
        mean = self._mean
        count = self._count
        diff = x - mean
        spike = None
        if count < self._warmup:
            # A weight of 1/n makes the update below the plain running mean and variance.
            weight = 1.0 / (count + 1)
        else:
            # The running standard deviation, floored. In log space a difference already is a
            # ratio, so the relative floor applies as is.
            std = math.sqrt(self._var)
            relative = REL_STD_FLOOR if self._log_scale else REL_STD_FLOOR * abs(mean)
            if std < relative:
                std = relative
            if std < ABS_STD_FLOOR:
                std = ABS_STD_FLOOR
            zscore = diff / std
            threshold = self._threshold
            if zscore > threshold:
                level = math.exp(mean) if self._log_scale else mean
                if value - level >= self._min_delta and (
                    value >= level * self._min_ratio if level > 0 else True
                ):
                    self._run += 1
                    self._quiet = 0
                    spike = Spike(value=float(value), zscore=zscore, mean=level,
                                  run_length=self._run)  # fmt: skip
                diff = threshold * std  # enters the statistics clamped to mean + threshold*std
            elif zscore < -threshold:
                diff = -threshold * std
            if spike is None and self._run:
                self._quiet += 1
                if self._quiet >= self._episode_gap:
                    self._run = 0  # the episode is over: the next spike is a new incident
            weight = self._alpha
        increment = weight * diff
        self._mean = mean + increment
        self._var = (1.0 - weight) * (self._var + diff * increment)
        self._count = count + 1
        return spike

    def limit(self) -> float | None:
        """The smallest value :meth:`update` would call a spike now (in the original space);
        None during warm-up. Known before the next value arrives, so a policy can judge that
        value on the device (stabmon.policies) without the value ever reaching the host."""
        if self._count < self._warmup:
            return None
        mean = self._mean
        std = math.sqrt(self._var)
        relative = REL_STD_FLOOR if self._log_scale else REL_STD_FLOOR * abs(mean)
        std = max(std, relative, ABS_STD_FLOOR)
        edge = mean + self._threshold * std
        level = math.exp(mean) if self._log_scale else mean
        if self._log_scale:
            edge = math.exp(min(edge, 700.0))
        floor = level + self._min_delta
        if level > 0:
            floor = max(floor, level * self._min_ratio)
        return max(edge, floor)

    def state_dict(self) -> dict[str, float | int]:
        """The running statistics, as JSON-able numbers; see :meth:`load_state_dict`."""
        return {"count": self._count, "mean": self._mean, "var": self._var}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Continue from statistics saved by :meth:`state_dict`.

        Raises ValueError, and leaves the detector unchanged, when ``state`` is malformed.
        """
        if set(state) != _STATE_KEYS:
            raise ValueError(
                f"SpikeDetector state must have exactly the keys {sorted(_STATE_KEYS)} "
                f"(as saved by state_dict()), got {sorted(state)}"
            )
        count, mean, var = state["count"], state["mean"], state["var"]
        if not _is_int(count) or count < 0:
            raise ValueError(f"SpikeDetector state 'count' must be an integer >= 0, got {count!r}")
        if not _is_finite_number(mean):
            raise ValueError(f"SpikeDetector state 'mean' must be a finite number, got {mean!r}")
        if not _is_finite_number(var) or var < 0:
            raise ValueError(f"SpikeDetector state 'var' must be a finite number >= 0, got {var!r}")
        self._count = count
        self._mean = float(mean)
        self._var = float(var)


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True is no count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
