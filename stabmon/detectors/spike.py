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
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from stabmon.config import Config
    from stabmon.extension import Context
    from stabmon.probes.grads import GradSummary

__all__ = [
    "ABS_STD_FLOOR",
    "CLIPPED_SPIKE_STEPS",
    "IMMEDIATE_LOSS_RATIO",
    "REL_STD_FLOOR",
    "GradSpikes",
    "LossSpikes",
    "Spike",
    "SpikeDetector",
]

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


#: A loss this many times its running mean is a spike at once (a corrupt batch); a smaller
#: rise (loss_spike_min_ratio and up) is one when the next loss is still up.
IMMEDIATE_LOSS_RATIO = 10.0
#: A gradient spike that the loop's clip absorbed is an incident when this many consecutive
#: measured steps are grad_spike_min_ratio above the level before it (an RNN clipped at 0.25
#: explodes for one or two steps and recovers; weights wrecked by an LR blow-up do not).
CLIPPED_SPIKE_STEPS = 3


class _SpikeRule:
    """What the loss and gradient-norm rules share: the detector, its state and the record."""

    component = "detectors"
    state_key: str
    #: The anomaly kind, what the message calls the value, and the record's field for it.
    _kind: str
    _what: str
    _field: str

    def __init__(self, context: Context) -> None:
        self._context = context
        self._config = context.config
        self._detector = self._new_detector(context.config)

    @staticmethod
    def _new_detector(config: Config) -> SpikeDetector:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float | int]:
        return self._detector.state_dict()

    def load_state_dict(self, state: Any) -> None:
        detector = self._new_detector(self._config)
        detector.load_state_dict(state)  # ValueError, or TypeError: not a mapping
        self._detector = detector

    def _record(self, step: int, spike: Spike, first_step: int | None = None) -> None:
        if spike.run_length != 1 and first_step is None:  # one incident, one anomaly
            return
        since = "" if first_step is None else f" (up since step {first_step}, and still up)"
        self._context.anomaly(
            self._kind,
            step,
            f"{self._what} spike at step {step}: {spike.value:.4g} (z={spike.zscore:.1f}, "
            f"running mean {spike.mean:.4g}){since}",
            **{self._field: spike.value},
            zscore=spike.zscore,
            mean=spike.mean,
            first_step=step if first_step is None else first_step,
        )


class GradSpikes(_SpikeRule):
    """Plug-in: a gradient-norm spike (log scale: norms vary multiplicatively).

    A spike the loop's clip absorbed is an incident only when it persists for
    :data:`CLIPPED_SPIKE_STEPS` measured steps (an LR blow-up, not an RNN's exploding step);
    it is then recorded at its first step.
    """

    state_key = "grad_spikes"
    _kind, _what, _field = "grad_spike", "gradient norm", "grad_norm"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._max_norm: float | None = None  # the loop's last clip
        # A spike the clip absorbed, waiting for later measured steps to confirm it.
        self._pending: tuple[int, Spike, int] | None = None

    @staticmethod
    def _new_detector(config: Config) -> SpikeDetector:
        return SpikeDetector(
            threshold=config.spike_threshold, warmup=config.spike_warmup_steps,
            alpha=config.spike_ema_alpha, log_scale=True, min_ratio=config.grad_spike_min_ratio,
            episode_gap=config.spike_episode_gap,
        )  # fmt: skip

    def clip_judged(self, step: int, max_norm: float) -> None:
        self._max_norm = max_norm

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        if summary.nonfinite:
            return
        total = summary.total_norm
        spike = self._detector.update(total)
        pending, self._pending = self._pending, None
        cfg = self._config
        if pending is not None and still_up(
            total, pending[1], cfg.grad_spike_min_ratio, cfg.spike_threshold, log_scale=True
        ):
            first_step, first, high = pending
            if high + 1 < CLIPPED_SPIKE_STEPS:
                self._pending = (first_step, first, high + 1)
                return
            # Still far above the level before it: an incident, recorded at its first step.
            self._record(first_step, first, first_step=first_step)
            return
        if spike is None or spike.run_length != 1:
            return
        max_norm = self._max_norm
        if max_norm is not None and total > max_norm:
            # The clip absorbed it: a clipped spike (an RNN's exploding step) is no
            # incident unless it persists (an LR blow-up), see CLIPPED_SPIKE_STEPS.
            self._pending = (step, spike, 1)
            return
        self._record(step, spike)


class LossSpikes(_SpikeRule):
    """Plug-in: a loss spike. Ten times the running mean is one at once (a corrupt batch); a
    smaller rise is one when the next loss is still up (a hard batch is not)."""

    state_key = "loss_spikes"
    _kind, _what, _field = "loss_spike", "loss", "loss"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        # A moderate loss spike, waiting for the next loss to confirm it.
        self._pending: tuple[int, Spike] | None = None

    @staticmethod
    def _new_detector(config: Config) -> SpikeDetector:
        return SpikeDetector(
            threshold=config.spike_threshold, warmup=config.spike_warmup_steps,
            alpha=config.spike_ema_alpha, min_delta=config.loss_spike_min_delta,
            min_ratio=config.loss_spike_min_ratio, episode_gap=config.spike_episode_gap,
        )  # fmt: skip

    def loss_judged(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return
        spike = self._detector.update(value)
        pending, self._pending = self._pending, None
        cfg = self._config
        if pending is not None and still_up(
            value, pending[1], cfg.loss_spike_min_ratio, cfg.spike_threshold, log_scale=False
        ):
            # The rise persists past one batch: an incident, recorded at its first step.
            self._record(pending[0], pending[1], first_step=pending[0])
            return
        if spike is None or spike.run_length != 1:
            return
        if spike.mean > 0 and value < IMMEDIATE_LOSS_RATIO * spike.mean:
            # A few times the mean for one batch is a hard batch (label noise, a rare class);
            # it is a spike if the next loss is still up.
            self._pending = (step, spike)
            return
        self._record(step, spike)


def still_up(value: float, spike: Spike, min_ratio: float, threshold: float, *,
             log_scale: bool) -> bool:  # fmt: skip
    """Whether ``value`` (after ``spike``) is still abnormal: ``min_ratio`` times the level
    before the spike, and half the spike threshold in standard deviations above it (the
    deviation is the spike's own: its rise over its z-score)."""
    mean = spike.mean
    if not (value >= min_ratio * mean and spike.zscore > 0):
        return False
    if log_scale:
        if not (mean > 0 and spike.value > 0 and value > 0):
            return False
        std = math.log(spike.value / mean) / spike.zscore
        return math.log(value / mean) >= 0.5 * threshold * std
    std = (spike.value - mean) / spike.zscore
    return value - mean >= 0.5 * threshold * std


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True is no count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
