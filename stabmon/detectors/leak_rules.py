"""Memory leaks by two rules, reconciled into one anomaly per leak, and time to exhaustion.

- The *epoch-window* rule (:class:`~stabmon.detectors.leak.LeakDetector`): memory at epoch
  ends grew more than ``leak_threshold`` in ``leak_windows`` consecutive windows of
  ``leak_window_epochs`` epochs (one team's rule, for loops with epochs).
- The *trend* rule (:class:`~stabmon.detectors.trend.MemoryTrend`): memory sampled at step
  ends, at most ``leak_sample_steps`` steps and ``leak_sample_seconds`` of loop time apart,
  keeps growing (Mann-Kendall over bucket floors), for loops whose epochs are long or never
  end. It is judged at four scales at once (:data:`SCALES`), so its latency is stated in
  time whatever the step time (0.05 s or 10 s): ``slow`` (floors of 15 x
  ``leak_trend_bucket`` seconds, 150 s by default: a window of an hour, judged from half of
  it) needs ``leak_trend_min_growth`` (2%), so a leak of 5% an hour is flagged within about
  45 minutes of its start; ``fast`` (floors of ``leak_trend_bucket`` seconds: a window of 4
  minutes) needs 5x that (10%), so a leak that doubles memory in 10 minutes is flagged
  within about 2.5 minutes; ``short`` (one sample a floor: 24 samples, at most 240 steps)
  needs 3x that (6%), so a run of a few hundred steps whose memory grows unmistakably (a
  VAE's +10% in 300 steps) is flagged before it ends; ``steps`` (floors of 10 samples, at
  most 100 steps) needs 2%, as the rule counted in steps before (a ``total_loss += loss``
  in a fast loop whose run is over before a time scale has judged). Each scale also needs
  its window's second half to grow (a warm-up that flattened is no leak), and nothing is
  sampled before ``leak_trend_warmup_steps`` steps or ``WARMUP_SECONDS`` of loop time,
  whichever comes first.

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

__all__ = ["SCALES", "WARMUP_SECONDS", "MemoryLeaks"]

#: The trend rule's scales: name, samples per floor (when floors are counted in samples),
#: seconds per floor in units of ``leak_trend_bucket`` (when they are measured in time), and
#: the growth each needs in units of ``leak_trend_min_growth``.
SCALES: tuple[tuple[str, int, float | None, float], ...] = (
    ("short", 1, None, 3.0),
    ("steps", 10, None, 1.0),
    ("fast", 1, 1.0, 5.0),
    ("slow", 1, 15.0, 1.0),
)
#: Loop time after attach (on the loop clock) after which the trend rule samples, even
#: before ``leak_trend_warmup_steps`` steps (a loop of 10 s steps warms up in a few).
WARMUP_SECONDS = 60.0


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
        self._attached_at = context.heartbeat.last_beat  # attach, on the loop clock
        self._warm = False
        #: The next step end that samples memory (the first one: see _steps_to_next).
        self.next_step = 1
        self._leaks: dict[str, LeakDetector] = {}
        self._trends: dict[str, list[MemoryTrend]] = {}
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
        now = self._heartbeat.last_beat  # this step's end, on the loop clock
        self.next_step = steps + self._steps_to_next()
        if not self._warm:
            cfg = self._config
            warm_steps = steps >= cfg.leak_trend_warmup_steps
            self._warm = warm_steps or now - self._attached_at >= WARMUP_SECONDS
            if not self._warm:
                return
        samples = self._memory.trend_samples()
        with self._context.judging():
            self.trend(samples, self._memory.limits, now, steps)

    def _steps_to_next(self) -> int:
        """Steps to the next sample: leak_sample_steps, or fewer so that samples are at most
        leak_sample_seconds apart at the median step time."""
        median = self._heartbeat.median_step_seconds()
        if not median or median <= 0:
            return 1
        return max(1, min(int(self._every), int(self._config.leak_sample_seconds / median)))

    def trend(
        self,
        samples: Mapping[str, float],
        limits: Callable[[], Mapping[str, float]],
        now: float,
        steps: int | None = None,
    ) -> None:
        """Memory samples taken at ``now`` (the loop clock): the trend rule at each of its
        scales, drift in loops whose epochs never end, and the time-to-exhaustion estimate.
        ``limits()`` gives the bytes each label may reach."""
        cfg = self._config
        readings = self._readings
        for label, value in samples.items():
            trends = self._trends.get(label)
            if trends is None:
                trends = self._trends[label] = [_new_trend(cfg, scale) for scale in SCALES]
                # The series exists from the first sample (a scrape's series count is stable).
                readings.memory_exhaustion_seconds.setdefault(label, math.inf)
            verdicts = [trend.update(value, now) for trend in trends]
            short, judged = trends[0], [v for v in verdicts if v is not None]
            if not judged:
                continue
            if short.baseline and verdicts[0] is not None and label not in readings.epoch_memory:
                readings.memory_drift[label] = (verdicts[0].floor - short.baseline) / short.baseline
            self._exhaustion(label, value, verdicts, limits)
            if cfg.leak_rule == "epoch_windows":
                continue
            reported = self._holds(label)
            suspected = [
                (scale, verdict)
                for scale, verdict, trend in zip(SCALES, verdicts, trends, strict=True)
                if (verdict.suspected if verdict is not None else trend.suspected)
            ]
            self._trend_suspected[label] = bool(suspected)
            newly = [(s, v) for s, v in suspected if v is not None and v.newly_suspected]
            if newly and not reported:
                self._trend_anomaly(label, value, newly[0][0], newly[0][1], steps)
            self._holds(label)

    def _trend_anomaly(
        self,
        label: str,
        value: float,
        scale: tuple[str, int, float | None, float],
        verdict: TrendVerdict,
        steps: int | None,
    ) -> None:
        cfg = self._config
        name, samples, floor_units, _ = scale
        span = (
            f"{cfg.leak_trend_window * samples} samples"
            if floor_units is None
            else f"{cfg.leak_trend_window * floor_units * cfg.leak_trend_bucket / 60:.0f} min"
        )
        rate = ""
        if verdict.per_second is not None and value > 0:
            rate = f", {verdict.per_second * 3600 / value:+.1%} an hour"
        self._context.anomaly(
            "memory_leak",
            self._context.last_step,  # sampled at its end
            f"memory on {label} keeps growing: {verdict.growth:+.1%} over the last {span} "
            f"({name} scale, Mann-Kendall z={verdict.zscore:.1f}{rate}); now "
            f"{value / 2**20:.1f} MiB. Look for tensors kept across steps (a loss summed "
            "without .item() or .detach(), outputs appended to a list), caches that never "
            "evict, or a DataLoader worker's copy-on-read growth; a memory snapshot "
            "(memory_snapshot_steps) shows what grows",
            device=label,
            bytes=value,
            rule="trend",
            scale=name,
            zscore=round(verdict.zscore, 2),
            growth=round(verdict.growth, 4),
            bytes_per_second=verdict.per_second,
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
        verdicts: list[TrendVerdict | None],
        limits: Callable[[], Mapping[str, float]],
    ) -> None:
        """Seconds until ``label`` runs out at the trend of the longest time scale that sees
        one (z >= 2); +Inf while none does. Written when a time scale closes a floor."""
        timed = [v for v in verdicts if v is not None and v.per_second is not None]
        if not timed:
            return
        seconds = math.inf
        for verdict in reversed(verdicts):  # the slow scale first
            if verdict is None or verdict.per_second is None:
                continue
            if verdict.zscore >= 2.0 and verdict.per_second > 0:
                limit = limits().get(label)
                if limit is not None:
                    seconds = max(0.0, limit - value) / verdict.per_second
                break
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


def _new_trend(cfg: Config, scale: tuple[str, int, float | None, float]) -> MemoryTrend:
    _, samples, floor_units, growth_units = scale
    return MemoryTrend(
        bucket=samples, window=cfg.leak_trend_window, min_floors=cfg.leak_trend_window // 2,
        z_threshold=cfg.leak_trend_z, min_growth=cfg.leak_trend_min_growth * growth_units,
        bucket_seconds=None if floor_units is None else floor_units * cfg.leak_trend_bucket,
    )  # fmt: skip
