"""Counting, records and step numbers: what every verdict goes through on its way out.

The Recorder writes the read-back values to :class:`~stabmon.pipeline.readings.Readings` (what
the exporter publishes), counts anomalies, writes the event log and the rate-limited
log lines, feeds the step sampler, and numbers steps across resumes. The verdicts
themselves are the plug-ins' (:mod:`stabmon.detectors`, through the ports of
:mod:`stabmon.extension`). It holds no reference to the Monitor, the model or any
thread, so a Monitor that is dropped without ``detach()`` can still be collected.

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stabmon.config import Config
from stabmon.detectors.stall import StallReport
from stabmon.errors import StabmonError
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.step_sampler import StepSampler
from stabmon.probes.grads import GradSummary
from stabmon.shared.log import LOGGER, LogLimiter

if TYPE_CHECKING:
    from stabmon.export.event_log import EventLog

__all__ = ["STATE_VERSION", "Recorder"]

STATE_VERSION = 2
#: The Recorder's own keys of Monitor.state_dict(); plug-ins add theirs (extension.Stateful).
STATE_KEYS = ("version", "step", "epoch")


class Recorder:
    """Judges host values and records the verdicts (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        readings: Readings,
        *,
        events: EventLog | None,
        limiter: LogLimiter,
        on_anomaly: Callable[[str, int | None], None] | None = None,
    ) -> None:
        self._config = config
        #: Told of each anomaly once it is written (the plug-ins' anomaly_recorded).
        self._on_anomaly = on_anomaly
        self._readings = readings
        self._events = events
        self._limiter = limiter
        self.step_offset = 0
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

    def grads(self, step: int, summary: GradSummary) -> None:
        """One measured step's gradients: the readings and the step sample."""
        self._readings.grads = summary  # group sums are computed when a scrape reads them
        if step >= self.sampler.due:  # between samples: this comparison is all
            self.sampler.grads(step, summary.total_norm, summary.group_norms)

    def loss(self, step: int, value: float) -> None:
        """One observed training loss: the reading and the step sample."""
        self._readings.loss = value
        if step >= self.sampler.due:
            self.sampler.loss(step, value)

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

    # --- per epoch ----------------------------------------------------------------------------

    def epoch(
        self,
        samples: Mapping[str, float],
        peaks: Mapping[str, float],
        drift: Mapping[str, float | None],
    ) -> None:
        """Close the epoch: its record (memory samples, peaks and drift by device label)."""
        readings = self._readings
        self.write(
            "epoch",
            epoch=readings.epoch,
            step=self.last_step,  # the epoch's last step
            memory=dict(samples),
            peak=dict(peaks),
            drift=dict(drift),
            leak_suspected={label: bool(v) for label, v in readings.memory_leak_suspected.items()},
            grad_norm=readings.grad_norm,
            loss=readings.loss,
            anomalies={kind: n for kind, n in readings.anomalies.items() if n},
        )
        readings.epoch += 1

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
        """Write the step sample still waiting for a value (at the last judgement)."""
        self.sampler.flush()

    def detached(self) -> None:
        """The detach record: the last step completed and the epoch in progress."""
        self.write("detach", step=self.last_step, epoch=self._readings.epoch)

    def anomaly(self, kind: str, step: int | None, message: str, **details: Any) -> None:
        self._readings.count_anomaly(kind)
        self.write(
            "anomaly", kind=kind, step=step, epoch=self._readings.epoch, detail=message, **details
        )
        self._limiter.limited(f"anomaly:{kind}", logging.WARNING, "stabmon: %s", message)
        if self._on_anomaly is not None:
            self._on_anomaly(kind, step)

    def write(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(event, **fields)

    def log(self, key: str, level: int, message: str, *args: object) -> None:
        self._limiter.limited(key, level, message, *args)

    # --- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The numbering: steps completed across resumes and the epoch in progress."""
        return {"version": STATE_VERSION, "step": self.global_step, "epoch": self._readings.epoch}

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        required: Sequence[str] = (),
        restore: Callable[[Mapping[str, Any]], None] = lambda state: None,
    ) -> None:
        """Continue numbering, and ``restore`` the plug-ins' state (their ``required`` keys);
        checks everything before changing anything."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StabmonError(
                f"not a stabmon Monitor state of version {STATE_VERSION} (got "
                f"{type(state).__name__} with version {_version_of(state)!r}); pass what "
                "Monitor.state_dict() returned"
            )
        missing = sorted({"step", "epoch", *required} - set(state))
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
        try:
            restore(state)
        except (TypeError, ValueError) as error:
            raise StabmonError(f"stabmon Monitor state is malformed: {error}") from error
        self.step_offset = step - self._readings.steps
        self._readings.epoch = epoch
        # Numbering continues after the checkpoint's last completed step (``step`` counts them).
        self.write("resume", step=step - 1 if step else None, epoch=epoch)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _version_of(state: object) -> object:
    return state.get("version") if isinstance(state, Mapping) else None
