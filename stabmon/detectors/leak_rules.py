"""Memory leaks by two rules, reconciled into one anomaly per leak, and time to exhaustion.

- The *epoch-window* rule (:class:`~stabmon.detectors.leak.LeakDetector`): memory at epoch
  ends grew more than ``leak_threshold`` in ``leak_windows`` consecutive windows of
  ``leak_window_epochs`` epochs (one team's rule, for loops with epochs).
- The *trend* rule (:class:`~stabmon.detectors.trend.MemoryTrend`): memory sampled every
  ``leak_sample_steps`` steps keeps growing (Mann-Kendall over bucket floors), for loops
  whose epochs are long or never end.

A leak reported by one rule is not reported again by the other while either still holds
(``leak_rule`` picks one or both). The trend's slope also gives
``stabmon_memory_exhaustion_seconds``: when memory runs out at that pace.

Threads: ``epoch_memory`` runs on the training thread at an epoch end; ``step_end`` samples
memory there too and judges it under the judging lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from stabmon.detectors.leak import LeakDetector
from stabmon.detectors.trend import MemoryTrend, TrendVerdict

if TYPE_CHECKING:
    from stabmon.config import Config
    from stabmon.extension import Context

__all__ = ["MemoryLeaks"]


class MemoryLeaks:
    """Plug-in: ``memory_leak`` anomalies, drift, the suspected gauge and exhaustion time."""

    component = "memory"
    state_key = "leaks"

    def __init__(self, context: Context) -> None:
        config = self._config = context.config
        self._context = context
        self._readings = context.readings
        self._memory = context.memory
        self._heartbeat = context.heartbeat
        self._every = config.leak_sample_steps
        #: The first multiple of leak_sample_steps past the trend rule's warm-up.
        self.next_step = (config.leak_trend_warmup_steps // self._every + 1) * self._every
        self._leaks: dict[str, LeakDetector] = {}
        self._trends: dict[str, MemoryTrend] = {}
        # Labels whose leak was reported and still holds (by either rule): one anomaly per leak.
        self._reported: set[str] = set()
        self._epoch_suspected: dict[str, bool] = {}
        self._trend_suspected: dict[str, bool] = {}

    # --- the epoch-window rule (training thread, at an epoch end) ----------------------------

    def epoch_memory(self, samples: Mapping[str, float]) -> dict[str, float | None]:
        """Judge the epoch-end samples (bytes by device label); returns the drift by label."""
        readings = self._readings
        drift: dict[str, float | None] = {}
        for label, value in samples.items():
            verdict = self._leak_detector(label).update(readings.epoch, value)
            readings.epoch_memory[label] = value
            drift[label] = verdict.drift
            if verdict.drift is not None:
                readings.memory_drift[label] = verdict.drift
            if self._config.leak_rule == "trend":
                continue
            self._epoch_suspected[label] = verdict.suspected
            if not self._holds(label) and verdict.newly_suspected:
                cfg = self._config
                self._context.anomaly(
                    "memory_leak",
                    self._context.last_step,  # the epoch's last step
                    f"memory on {label} grew more than {cfg.leak_threshold:.1%} in "
                    f"{cfg.leak_windows} consecutive windows of {cfg.leak_window_epochs} "
                    f"epoch(s); now {value / 2**20:.1f} MiB, {verdict.drift or 0.0:+.1%} "
                    "against the baseline epoch",
                    device=label,
                    bytes=value,
                    drift=verdict.drift,
                )
        return drift

    # --- the trend rule (every leak_sample_steps steps) ---------------------------------------

    def step_end(self, steps: int) -> None:
        self.next_step = (steps // self._every + 1) * self._every
        samples = self._memory.trend_samples()
        with self._context.judging():
            self.trend(samples, self._memory.limits, self._heartbeat.median_step_seconds())

    def trend(
        self,
        samples: Mapping[str, float],
        limits: Callable[[], Mapping[str, float]],
        step_seconds: float | None,
    ) -> None:
        """Memory samples taken every ``leak_sample_steps`` steps: the trend rule, drift in
        loops whose epochs never end, and the time-to-exhaustion estimate. ``limits()``
        gives the bytes each label may reach."""
        cfg = self._config
        readings = self._readings
        for label, value in samples.items():
            trend = self._trends.get(label)
            if trend is None:
                trend = self._trends[label] = _new_trend(cfg)
            verdict = trend.update(value)
            if verdict is None:
                continue
            if trend.baseline and label not in readings.epoch_memory:  # no epoch ended yet
                readings.memory_drift[label] = (verdict.floor - trend.baseline) / trend.baseline
            self._exhaustion(label, value, verdict, limits, step_seconds)
            if cfg.leak_rule == "epoch_windows":
                continue
            reported = self._holds(label)
            self._trend_suspected[label] = verdict.suspected
            if verdict.newly_suspected and not reported:
                self._trend_anomaly(label, value, verdict)
            self._holds(label)

    def _trend_anomaly(self, label: str, value: float, verdict: TrendVerdict) -> None:
        cfg = self._config
        self._context.anomaly(
            "memory_leak",
            self._context.last_step,  # sampled at its end
            f"memory on {label} keeps growing: {verdict.growth:+.1%} over the last "
            f"{cfg.leak_trend_window} floors of {cfg.leak_trend_bucket} samples "
            f"(Mann-Kendall z={verdict.zscore:.1f}, "
            f"{verdict.slope / cfg.leak_sample_steps:.0f} bytes/step); now "
            f"{value / 2**20:.1f} MiB",
            device=label,
            bytes=value,
            rule="trend",
            zscore=round(verdict.zscore, 2),
            bytes_per_step=verdict.slope / cfg.leak_sample_steps,
        )

    def _holds(self, label: str) -> bool:
        """Whether a leak of ``label`` was reported and held before this call; keeps the
        suspected gauge and the reported set (a leak reported by one rule is not reported
        again by the other while either holds)."""
        holds = self._epoch_suspected.get(label, False) or self._trend_suspected.get(label, False)
        self._readings.memory_leak_suspected[label] = int(holds)
        was = label in self._reported
        if holds:
            self._reported.add(label)
        else:
            self._reported.discard(label)
        return was

    def _exhaustion(
        self,
        label: str,
        value: float,
        verdict: TrendVerdict,
        limits: Callable[[], Mapping[str, float]],
        step_seconds: float | None,
    ) -> None:
        """Seconds until ``label`` runs out at the window's trend; +Inf while it does not grow."""
        seconds = math.inf
        per_step = verdict.slope / self._config.leak_sample_steps
        if verdict.zscore >= 2.0 and per_step > 0 and step_seconds:
            limit = limits().get(label)
            if limit is not None:
                seconds = max(0.0, limit - value) / (per_step / step_seconds)
        self._readings.memory_exhaustion_seconds[label] = seconds

    # --- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {device: leak.state_dict() for device, leak in self._leaks.items()}

    def load_state_dict(self, state: Any) -> None:
        """Continue each device's baseline and windows; checks every device before any."""
        loaded = {label: _new_leak(self._config) for label in dict(state)}
        for label, leak_state in dict(state).items():
            loaded[label].load_state_dict(leak_state)
        self._leaks.update(loaded)

    def _leak_detector(self, label: str) -> LeakDetector:
        detector = self._leaks.get(label)
        if detector is None:
            detector = self._leaks[label] = _new_leak(self._config)
        return detector


def _new_leak(cfg: Config) -> LeakDetector:
    return LeakDetector(
        threshold=cfg.leak_threshold, windows=cfg.leak_windows,
        window_epochs=cfg.leak_window_epochs, warmup_epochs=cfg.leak_warmup_epochs,
    )  # fmt: skip


def _new_trend(cfg: Config) -> MemoryTrend:
    return MemoryTrend(
        bucket=cfg.leak_trend_bucket, window=cfg.leak_trend_window,
        min_floors=cfg.leak_trend_window // 2, z_threshold=cfg.leak_trend_z,
        min_growth=cfg.leak_trend_min_growth,
    )  # fmt: skip
