"""When a spike is an incident: the loss and gradient-norm rules built on the spike detector.

:class:`~stabmon.detectors.spike.SpikeDetector` says a value is far above its running
level; these plug-ins decide what a user is told. A loss ten times its mean is an incident
at once (a corrupt batch); a smaller rise must persist to the next loss (a hard batch does
not). A gradient spike the loop's clip absorbed must persist for a few measured steps (an
LR blow-up does, an RNN's exploding step does not). A gradient spike names the module
groups that grew most against their own recent level, and what to look at next.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from stabmon.detectors.spike import Spike, SpikeDetector

if TYPE_CHECKING:
    from stabmon.config import Config
    from stabmon.extension import Context
    from stabmon.probes.grads import GradSummary

__all__ = [
    "CLIPPED_SPIKE_STEPS",
    "IMMEDIATE_LOSS_RATIO",
    "GradSpikes",
    "LossSpikes",
    "still_up",
]

#: A loss this many times its running mean is a spike at once (a corrupt batch); a smaller
#: rise (loss_spike_min_ratio and up) is one when the next loss is still up.
IMMEDIATE_LOSS_RATIO = 10.0
#: A gradient spike that the loop's clip absorbed is an incident when this many consecutive
#: measured steps are grad_spike_min_ratio above the level before it (an RNN clipped at 0.25
#: explodes for one or two steps and recovers; weights wrecked by an LR blow-up do not).
CLIPPED_SPIKE_STEPS = 3
#: A gradient spike names at most this many module groups, those that grew most.
SPIKE_GROUPS = 3
#: Measured steps between samples of each module group's level, and samples kept: the level
#: a spiking group is compared with is the median of the last GROUP_LEVELS samples.
GROUP_LEVEL_STEPS = 10
GROUP_LEVELS = 8


class _Where(NamedTuple):
    """Where a gradient spike grew most: the message's clause and the record's fields."""

    text: str
    details: dict[str, Any]


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

    def _record(
        self, step: int, spike: Spike, first_step: int | None = None, *, where: str = "",
        **details: Any,
    ) -> None:  # fmt: skip
        if spike.run_length != 1 and first_step is None:  # one incident, one anomaly
            return
        since = "" if first_step is None else f" (up since step {first_step}, and still up)"
        self._context.anomaly(
            self._kind,
            step,
            f"{self._what} spike at step {step}: {spike.value:.4g} (z={spike.zscore:.1f}, "
            f"running mean {spike.mean:.4g}){since}{where}",
            **{self._field: spike.value},
            zscore=spike.zscore,
            mean=spike.mean,
            first_step=step if first_step is None else first_step,
            **details,
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
        # A spike the clip absorbed, waiting for later measured steps to confirm it, with
        # where it grew most.
        self._pending: tuple[int, Spike, int, _Where] | None = None
        # Each module group's recent level: its norms every GROUP_LEVEL_STEPS measured steps.
        self._levels: deque[dict[str, float]] = deque(maxlen=GROUP_LEVELS)
        self._measured = 0

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
            first_step, first, high, where = pending
            if high + 1 < CLIPPED_SPIKE_STEPS:
                self._pending = (first_step, first, high + 1, where)
                return
            # Still far above the level before it: an incident, recorded at its first step.
            self._record(first_step, first, first_step=first_step, where=where.text,
                         **where.details)  # fmt: skip
            return
        if spike is None:
            self._sample_levels(summary)  # a spike's own norms never raise the level
            return
        if spike.run_length != 1:
            return
        where = self._where(summary)
        max_norm = self._max_norm
        if max_norm is not None and total > max_norm:
            # The clip absorbed it: a clipped spike (an RNN's exploding step) is no
            # incident unless it persists (an LR blow-up), see CLIPPED_SPIKE_STEPS.
            self._pending = (step, spike, 1, where)
            return
        self._record(step, spike, where=where.text, **where.details)

    def _sample_levels(self, summary: GradSummary) -> None:
        """Every GROUP_LEVEL_STEPS measured steps, each group's norm (computed then only)."""
        self._measured += 1
        if self._measured % GROUP_LEVEL_STEPS == 0:
            self._levels.append(summary.group_norms)

    def _where(self, summary: GradSummary) -> _Where:
        """The module groups whose norm grew most against their own recent level."""
        if not self._levels:
            return _Where("", {})
        ratios: dict[str, float] = {}
        for group, norm in summary.group_norms.items():
            history = sorted(level[group] for level in self._levels if group in level)
            if history and math.isfinite(norm):
                median = history[len(history) // 2]
                ratios[group] = norm / median if median > 0 else math.inf
        grew = sorted((g for g in ratios if ratios[g] > 1.0), key=lambda g: -ratios[g])
        top = grew[:SPIKE_GROUPS]
        if not top:
            return _Where("", {})
        text = ", ".join(f"{g} (x{ratios[g]:.3g})" for g in top)
        return _Where(
            f"; grew most in {text} against their recent level: look at that part of the model "
            "and at this step's batch and learning rate",
            {"modules": top, "module_ratios": {g: round(ratios[g], 4) for g in top}},
        )


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
