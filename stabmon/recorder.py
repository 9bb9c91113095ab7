"""Host-side judgement: read-back values in; readings, event records and log lines out.

The Recorder is the one place where measurements become verdicts. It feeds the
spike and leak detectors, writes :class:`~stabmon.readings.Readings` (what the
exporter publishes), the event log and the rate-limited log lines. It holds no
reference to the Monitor, the model or any thread, so a Monitor that is dropped
without ``detach()`` can still be garbage-collected.

Threads: the Monitor judges read-back results on the training thread, or on its
judge thread when the loop is quiet, always under its judging lock, so no two
run at once. :meth:`stalled` and :meth:`resumed` run on the watchdog thread and
:meth:`worker_died` on the loader thread; they touch only their own gauges, the
anomaly counts and the event log (whose writes are serialised).

Step numbers (docs/steps.md): ``step`` in every record is the 0-based global index
of the step the record is about, across resumes. A value measured in a step, and a
step that hangs, carry that step's index; a record written between steps (epoch
end, detach, resume, a memory sample) carries the index of the last step completed,
or None before the first. Counters in Readings count this process only, so a
restart looks to Prometheus like the counter reset that ``rate()`` and
``increase()`` handle.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from stabmon.config import Config
from stabmon.detectors.dead import DeadReport, module_of
from stabmon.detectors.episodes import EpisodeChange, Episodes
from stabmon.detectors.leak import LeakDetector
from stabmon.detectors.spike import Spike, SpikeDetector
from stabmon.detectors.stall import StallReport
from stabmon.detectors.trend import MemoryTrend, TrendVerdict
from stabmon.errors import StabmonError
from stabmon.export.event_log import EventLog, StepSampler
from stabmon.log import LOGGER, LogLimiter
from stabmon.probes.amp import ScaleTracker
from stabmon.probes.grads import GradSummary
from stabmon.readings import Readings

__all__ = ["STATE_VERSION", "Recorder"]

STATE_VERSION = 2
#: A loss this many times its running mean is a spike at once (a corrupt batch); a smaller
#: rise (loss_spike_min_ratio and up) is one when the next loss is still up.
IMMEDIATE_LOSS_RATIO = 10.0
#: A gradient spike that the loop's clip absorbed is an incident when this many consecutive
#: measured steps are grad_spike_min_ratio above the level before it (an RNN clipped at 0.25
#: explodes for one or two steps and recovers; weights wrecked by an LR blow-up do not).
CLIPPED_SPIKE_STEPS = 3
HOST = "host"


class Recorder:
    """Judges host values and records the verdicts (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        readings: Readings,
        *,
        events: EventLog | None,
        limiter: LogLimiter,
    ) -> None:
        self._config = config
        self._readings = readings
        self._events = events
        self._limiter = limiter
        self.step_offset = 0
        self._loss_spikes, self._grad_spikes = self._new_spike_detectors()
        self._leaks: dict[str, LeakDetector] = {}
        self._trends: dict[str, MemoryTrend] = {}
        # Labels whose leak was reported and still holds (by either rule): one anomaly per leak.
        self._leak_reported: set[str] = set()
        self._epoch_suspected: dict[str, bool] = {}
        self._trend_suspected: dict[str, bool] = {}
        # Non-finite gradients and losses: one anomaly per episode, not one per step.
        self._nonfinite_grad_episodes = Episodes(config.spike_episode_gap)
        self._nonfinite_loss_episodes = Episodes(config.spike_episode_gap)
        self._nonfinite_groups: set[str] = set()
        # Clip coefficient: the clip's max_norm and the pre-clip total of the same step may
        # come in either order (a plain loop clips before its step is measured, Lightning after).
        self._clip_limit: tuple[int, float] | None = None
        self._measured_total: tuple[int, float] | None = None
        self._clip_judged = -1
        # A spike the clip absorbed, waiting for the next measured step to confirm it.
        self._pending_grad_spike: tuple[int, Spike, int] | None = None
        # A moderate loss spike, waiting for the next loss to confirm it.
        self._pending_loss_spike: tuple[int, Spike] | None = None
        self._scale = ScaleTracker()
        #: The step the open stall hangs in (its stall_end names the same step).
        self._stalled_step: int | None = None
        #: step_sample records; the Monitor closes their step-time windows at step ends.
        self.sampler = StepSampler(config.sample_every, readings, self.write)

    @property
    def global_step(self) -> int:
        """Optimizer steps completed, across resumes: the index of the step in progress."""
        return self.step_offset + self._readings.steps

    @property
    def last_step(self) -> int | None:
        """The index of the last step completed, across resumes; None before the first."""
        completed = self.step_offset + self._readings.steps
        return completed - 1 if completed else None

    # --- per step -----------------------------------------------------------------------------

    def grads(
        self, step: int, summary: GradSummary, offenders: Callable[[GradSummary], list[str]]
    ) -> None:
        """One measured step's gradients; ``offenders(summary)`` names the non-finite ones
        (called only then: it walks every norm)."""
        self._readings.grads = summary  # group sums are computed when a scrape reads them
        if step >= self.sampler.due:  # between samples: this comparison is all
            self.sampler.grads(step, summary.total_norm, summary.group_norms)
        change = self._nonfinite_grad_episodes.update(step, bad=summary.nonfinite)
        if summary.nonfinite:
            self._readings.nonfinite_grad_steps += 1
            groups = sorted(
                group for group, norm in summary.group_norms.items() if not math.isfinite(norm)
            )
            if change is None:  # the episode goes on: one record for all of it
                self._nonfinite_groups.update(groups)
                return
            self._nonfinite_groups = set(groups)
            names = offenders(summary)
            self.anomaly(
                "nonfinite_grad",
                step,
                f"non-finite gradient norm {summary.total_norm} at step {step} in module "
                f"group(s) {', '.join(groups) or 'unknown'}; further non-finite steps of this "
                "episode are counted, not recorded again",
                grad_norm=summary.total_norm,
                modules=groups,
                parameters=names,
            )
            return
        if change is not None:
            self._episode_end("nonfinite_grad", change, modules=sorted(self._nonfinite_groups))
        self._measured_total = (step, summary.total_norm)
        self._judge_clip()
        spike = self._grad_spikes.update(summary.total_norm)
        pending, self._pending_grad_spike = self._pending_grad_spike, None
        if pending is not None and _still_up(
            summary.total_norm, pending[1], self._config.grad_spike_min_ratio,
            self._config.spike_threshold, log_scale=True,
        ):  # fmt: skip
            first_step, first, high = pending
            if high + 1 < CLIPPED_SPIKE_STEPS:
                self._pending_grad_spike = (first_step, first, high + 1)
                return
            # Still far above the level before it: an incident, recorded at its first step.
            self._spike("grad_spike", "gradient norm", "grad_norm", first_step, first,
                        first_step=first_step)  # fmt: skip
            return
        if spike is None:
            return
        if spike.run_length == 1:
            limit = self._clip_limit
            if limit is not None and summary.total_norm > limit[1]:
                # The clip absorbed it: a clipped spike (an RNN's exploding step) is no
                # incident unless it persists (an LR blow-up), see CLIPPED_SPIKE_STEPS.
                self._pending_grad_spike = (step, spike, 1)
                return
            self._spike("grad_spike", "gradient norm", "grad_norm", step, spike)

    def loss(self, step: int, value: float) -> None:
        readings = self._readings
        readings.loss = value
        if step >= self.sampler.due:
            self.sampler.loss(step, value)
        change = self._nonfinite_loss_episodes.update(step, bad=not math.isfinite(value))
        if not math.isfinite(value):
            readings.nonfinite_losses += 1
            if change is not None:
                self.anomaly(
                    "nonfinite_loss",
                    step,
                    f"non-finite loss {value} at step {step}; further non-finite losses of this "
                    "episode are counted, not recorded again",
                    loss=value,
                )
            return
        if change is not None:
            self._episode_end("nonfinite_loss", change)
        spike = self._loss_spikes.update(value)
        pending, self._pending_loss_spike = self._pending_loss_spike, None
        cfg = self._config
        if pending is not None and _still_up(
            value, pending[1], cfg.loss_spike_min_ratio, cfg.spike_threshold, log_scale=False
        ):
            # The rise persists past one batch: an incident, recorded at its first step.
            self._spike("loss_spike", "loss", "loss", pending[0], pending[1], first_step=pending[0])
            return
        if spike is None or spike.run_length != 1:
            return
        if spike.mean > 0 and value < IMMEDIATE_LOSS_RATIO * spike.mean:
            # A few times the mean for one batch is a hard batch (label noise, a rare class);
            # it is a spike if the next loss is still up.
            self._pending_loss_spike = (step, spike)
            return
        self._spike("loss_spike", "loss", "loss", step, spike)

    def clip(self, step: int, max_norm: float) -> None:
        """The ``max_norm`` of the clip call of ``step`` (its pre-clip total comes from grads)."""
        self._clip_limit = (step, max_norm)
        self._judge_clip()

    def _judge_clip(self) -> None:
        limit, measured = self._clip_limit, self._measured_total
        if measured is None:
            return
        step, total = measured
        if step == self._clip_judged:
            return
        readings = self._readings
        if limit is None or limit[0] != step:
            readings.grad_clip_coefficient = 1.0  # not clipped (yet: a later clip may say so)
            return
        self._clip_judged = step
        # What torch's clip_grad_norm_ multiplies the gradients by.
        coefficient = min(1.0, limit[1] / (total + 1e-6))
        readings.grad_clip_coefficient = coefficient
        if coefficient < 1.0:
            readings.grad_clipped_steps += 1

    def _episode_end(self, kind: str, change: EpisodeChange, **details: Any) -> None:
        self.write(
            f"{kind}_end",
            step=change.last_step,
            first_step=change.first_step,
            last_step=change.last_step,
            count=change.count,
            **details,
        )

    def _spike(
        self, kind: str, what: str, field: str, step: int, spike: Spike,
        first_step: int | None = None,
    ) -> None:  # fmt: skip
        if spike.run_length != 1 and first_step is None:  # one incident, one anomaly
            return
        since = "" if first_step is None else f" (up since step {first_step}, and still up)"
        self.anomaly(
            kind,
            step,
            f"{what} spike at step {step}: {spike.value:.4g} (z={spike.zscore:.1f}, running "
            f"mean {spike.mean:.4g}){since}",
            **{field: spike.value},
            zscore=spike.zscore,
            mean=spike.mean,
            first_step=step if first_step is None else first_step,
        )

    def dead(self, step: int, report: DeadReport, by_group: Mapping[str, int]) -> None:
        """Dead branches: name the modules whose gradients stayed exactly zero for a window."""
        before = {group for group, count in self._readings.dead_grad_params.items() if count}
        self._readings.dead_grad_params = dict(by_group)
        if report.newly_dead:
            modules = sorted({module_of(name) or "(root)" for name in report.newly_dead})
            groups = sorted(group for group, count in by_group.items() if count)
            if set(groups) - before:  # a module group newly dead: one anomaly per episode
                self.anomaly(
                    "dead_grad",
                    step,
                    f"gradients of module group(s) {', '.join(groups)} have been exactly zero "
                    f"for {self._config.dead_grad_steps} measured steps at step {step}",
                    modules=groups,
                    parameters=list(report.newly_dead[:20]),
                )
            self.write(
                "dead_gradients",
                step=step,
                modules=modules[:20],
                parameters=list(report.newly_dead[:20]),
                count=len(report.newly_dead),
            )
            self._limiter.limited(
                "dead_gradients",
                logging.WARNING,
                "stabmon: the gradient of %s has been exactly zero for %d measured steps "
                "(parameters %s): a dead branch, cut off by detach(), a mask, an unused output "
                "or a loss term that is always zero",
                ", ".join(modules[:5])
                + (f" and {len(modules) - 5} more" if len(modules) > 5 else ""),
                self._config.dead_grad_steps,
                ", ".join(report.newly_dead[:5]),
            )
        if report.revived:
            self.write("gradients_revived", step=step, parameters=list(report.revived[:20]))

    def worker_died(self, info: Mapping[str, Any]) -> None:
        """A data loader worker died while its loader still needed it (sampling thread)."""
        how = f"signal {info['signal']}" if info.get("signal") else f"exit code {info['exitcode']}"
        self.write("loader_worker_died", step=self.global_step, **info)
        self._limiter.limited(
            "loader_worker_died",
            logging.WARNING,
            "stabmon: data loader worker %s (pid %s) died with %s at step %d; SIGKILL is usually "
            "the OOM killer (see the workers' memory on the GPU nodes dashboard)",
            info.get("worker"),
            info.get("pid"),
            how,
            self.global_step,
        )

    def scale(self, step: int, scale: float) -> None:
        """One GradScaler scale per ``update()``; a drop means that step was skipped."""
        readings = self._readings
        readings.amp_loss_scale = scale
        if self._scale.update(scale):
            readings.amp_skipped_steps = (readings.amp_skipped_steps or 0) + 1
            run = self._scale.consecutive_skips
            self.write("amp_skip", step=step, scale=scale, consecutive=run)
            if run == self._config.amp_skip_run:  # once per run of skips
                self.anomaly(
                    "nonfinite_grad",
                    step,
                    f"GradScaler skipped {run} optimizer steps in a row at step {step} (loss "
                    f"scale now {scale:g}): the gradients are Inf/NaN at every scale it tries, "
                    "so the model has stopped training",
                    source="amp_skip_run",
                    consecutive=run,
                    scale=scale,
                )

    # --- per epoch ----------------------------------------------------------------------------

    def epoch(self, samples: Mapping[str, float], peaks: Mapping[str, float]) -> None:
        """Judge the epoch-end memory samples (bytes by device label) and close the epoch."""
        readings = self._readings
        epoch = readings.epoch
        step = self.last_step  # the epoch's last step
        drift: dict[str, float | None] = {}
        for label, value in samples.items():
            verdict = self._leak_detector(label).update(epoch, value)
            readings.epoch_memory[label] = value
            drift[label] = verdict.drift
            if verdict.drift is not None:
                readings.memory_drift[label] = verdict.drift
            if self._config.leak_rule == "trend":
                continue
            self._epoch_suspected[label] = verdict.suspected
            if not self._leak_holds(label) and verdict.newly_suspected:
                cfg = self._config
                self.anomaly(
                    "memory_leak",
                    step,
                    f"memory on {label} grew more than {cfg.leak_threshold:.1%} in "
                    f"{cfg.leak_windows} consecutive windows of {cfg.leak_window_epochs} "
                    f"epoch(s); now {value / 2**20:.1f} MiB, {verdict.drift or 0.0:+.1%} against "
                    "the baseline epoch",
                    device=label,
                    bytes=value,
                    drift=verdict.drift,
                )
        self.write(
            "epoch",
            epoch=epoch,
            step=step,
            memory=dict(samples),
            peak=dict(peaks),
            drift=drift,
            leak_suspected={label: bool(v) for label, v in readings.memory_leak_suspected.items()},
            grad_norm=readings.grad_norm,
            loss=readings.loss,
            anomalies={kind: n for kind, n in readings.anomalies.items() if n},
        )
        readings.epoch = epoch + 1

    def memory_trend(
        self,
        samples: Mapping[str, float],
        limits: Callable[[], Mapping[str, float]],
        step_seconds: float | None,
    ) -> None:
        """Memory samples taken every ``leak_sample_steps`` steps: the trend rule, drift in loops
        whose epochs never end, and the time-to-exhaustion estimate."""
        cfg = self._config
        readings = self._readings
        step = self.last_step  # sampled at its end
        for label, value in samples.items():
            trend = self._trends.get(label)
            if trend is None:
                trend = self._trends[label] = MemoryTrend(
                    bucket=cfg.leak_trend_bucket, window=cfg.leak_trend_window,
                    min_floors=cfg.leak_trend_window // 2, z_threshold=cfg.leak_trend_z,
                    min_growth=cfg.leak_trend_min_growth,
                )  # fmt: skip
            verdict = trend.update(value)
            if verdict is None:
                continue
            if trend.baseline and label not in readings.epoch_memory:  # no epoch ended yet
                readings.memory_drift[label] = (verdict.floor - trend.baseline) / trend.baseline
            self._exhaustion(label, value, verdict, limits, step_seconds)
            if cfg.leak_rule == "epoch_windows":
                continue
            reported = self._leak_holds(label)
            self._trend_suspected[label] = verdict.suspected
            if verdict.newly_suspected and not reported:
                self.anomaly(
                    "memory_leak",
                    step,
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
            self._leak_holds(label)

    def _leak_holds(self, label: str) -> bool:
        """Whether either rule holds for ``label`` now; keeps the suspected gauge and the
        reported set (a leak reported by one rule is not reported again by the other)."""
        holds = self._epoch_suspected.get(label, False) or self._trend_suspected.get(label, False)
        self._readings.memory_leak_suspected[label] = int(holds)
        was = label in self._leak_reported
        if holds:
            self._leak_reported.add(label)
        else:
            self._leak_reported.discard(label)
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

    # --- stalls (watchdog thread) -------------------------------------------------------------

    def stalled(self, report: StallReport) -> None:
        # The gauge first: the record's write may itself hang (a dead NFS mount), and the
        # alert must fire all the same.
        self._readings.stalled = 1
        step = self._stalled_step = self.global_step
        self.anomaly(
            "stall",
            step,
            # Step numbers are 0-based step indices (docs/steps.md): ``step`` steps have
            # completed, so the step that hangs is step ``step``.
            f"no step completed for {report.silent_seconds:.1f} s (limit "
            f"{report.limit_seconds:.1f} s): step {step} hangs, in phase {report.phase!r}; "
            "every thread's stack is in the event log",
            phase=report.phase,
            silent_seconds=round(report.silent_seconds, 3),
            limit_seconds=round(report.limit_seconds, 3),
            stacks=report.stacks,
        )

    def resumed(self, lasted: float) -> None:
        self._readings.stalled = 0
        # The same number as its stall record: the step that hung. A stall in a named phase
        # also ends when the phase ends, with that step still in progress: ``completed`` says
        # whether it did complete, and readers count it as done only then (docs/steps.md).
        step = self._stalled_step
        completed = step is not None and self.global_step > step
        self.write("stall_end", step=step, completed=completed, stalled_seconds=round(lasted, 3))
        if completed:
            LOGGER.info(
                "stabmon: step %s completed after a stall of %.1f s; steps resumed",
                step,
                lasted,
            )
        else:
            LOGGER.info(
                "stabmon: the stall in step %s ended after %.1f s (its phase ended or made "
                "progress); step %s has not completed yet",
                step,
                lasted,
                step,
            )

    # --- records ------------------------------------------------------------------------------

    def flush_sample(self) -> None:
        """Write the step sample still waiting for a value, and end open episodes (at detach)."""
        self.sampler.flush()
        change = self._nonfinite_grad_episodes.close()
        if change is not None:
            self._episode_end("nonfinite_grad", change, modules=sorted(self._nonfinite_groups))
        change = self._nonfinite_loss_episodes.close()
        if change is not None:
            self._episode_end("nonfinite_loss", change)

    def detached(self) -> None:
        """The detach record: the last step completed and the epoch in progress."""
        self.write("detach", step=self.last_step, epoch=self._readings.epoch)

    def anomaly(self, kind: str, step: int | None, message: str, **details: Any) -> None:
        self._readings.count_anomaly(kind)
        self.write(
            "anomaly", kind=kind, step=step, epoch=self._readings.epoch, detail=message, **details
        )
        self._limiter.limited(f"anomaly:{kind}", logging.WARNING, "stabmon: %s", message)

    def write(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(event, **fields)

    # --- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "step": self.global_step,
            "epoch": self._readings.epoch,
            "loss_spikes": self._loss_spikes.state_dict(),
            "grad_spikes": self._grad_spikes.state_dict(),
            "leaks": {device: leak.state_dict() for device, leak in self._leaks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue numbering and baselines; checks everything before changing anything."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StabmonError(
                f"not a stabmon Monitor state of version {STATE_VERSION} (got "
                f"{type(state).__name__} with version {_version_of(state)!r}); pass what "
                "Monitor.state_dict() returned"
            )
        missing = sorted({"step", "epoch", "loss_spikes", "grad_spikes", "leaks"} - set(state))
        if missing:
            raise StabmonError(
                f"stabmon Monitor state is missing key(s) {', '.join(missing)}; pass what "
                "Monitor.state_dict() returned"
            )
        step, epoch = state["step"], state["epoch"]
        if not (_is_count(step) and _is_count(epoch)):
            raise StabmonError(
                f"stabmon Monitor state has step={step!r}, epoch={epoch!r}; expected integers >= 0"
            )
        loss_spikes, grad_spikes = self._new_spike_detectors()
        try:
            leaks = {label: self._new_leak_detector() for label in dict(state["leaks"])}
            loss_spikes.load_state_dict(state["loss_spikes"])
            grad_spikes.load_state_dict(state["grad_spikes"])
            for label, leak_state in dict(state["leaks"]).items():
                leaks[label].load_state_dict(leak_state)
        except (TypeError, ValueError) as error:
            raise StabmonError(f"stabmon Monitor state is malformed: {error}") from error
        self.step_offset = step - self._readings.steps
        self._readings.epoch = epoch
        self._loss_spikes, self._grad_spikes = loss_spikes, grad_spikes
        self._leaks.update(leaks)
        # Numbering continues after the checkpoint's last completed step (``step`` counts them).
        self.write("resume", step=step - 1 if step else None, epoch=epoch)

    def _new_spike_detectors(self) -> tuple[SpikeDetector, SpikeDetector]:
        """Loss (linear) and gradient-norm (log scale: norms vary multiplicatively) detectors."""
        cfg = self._config
        threshold, warmup, alpha = cfg.spike_threshold, cfg.spike_warmup_steps, cfg.spike_ema_alpha
        gap = cfg.spike_episode_gap
        return (
            SpikeDetector(
                threshold=threshold, warmup=warmup, alpha=alpha, min_delta=cfg.loss_spike_min_delta,
                min_ratio=cfg.loss_spike_min_ratio, episode_gap=gap,
            ),
            SpikeDetector(
                threshold=threshold, warmup=warmup, alpha=alpha, log_scale=True,
                min_ratio=cfg.grad_spike_min_ratio, episode_gap=gap,
            ),
        )  # fmt: skip

    def _leak_detector(self, label: str) -> LeakDetector:
        detector = self._leaks.get(label)
        if detector is None:
            detector = self._leaks[label] = self._new_leak_detector()
        return detector

    def _new_leak_detector(self) -> LeakDetector:
        cfg = self._config
        return LeakDetector(
            threshold=cfg.leak_threshold,
            windows=cfg.leak_windows,
            window_epochs=cfg.leak_window_epochs,
            warmup_epochs=cfg.leak_warmup_epochs,
        )


def _still_up(value: float, spike: Spike, min_ratio: float, threshold: float, *,
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


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _version_of(state: object) -> object:
    return state.get("version") if isinstance(state, Mapping) else None
