"""AMP: skipped optimizer steps and a GradScaler that can no longer find a scale.

GradScaler lowers its scale (by ``backoff_factor``) exactly when it found Inf/NaN
gradients and skipped ``optimizer.step()``, so a skipped step is read from the scale's
history, one read-back value per ``update()`` (:mod:`stabmon.probes.amp` reads it without
a sync). ``amp_skip_run`` skips in a row mean the gradients are non-finite at every scale
it tries: the model has stopped training, a ``nonfinite_grad`` anomaly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["AmpScale", "ScaleTracker"]


class ScaleTracker:
    """Host-side judge of one scaler's scale history: one value per ``update()``."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.skipped = 0
        self.consecutive_skips = 0

    def update(self, scale: float) -> bool:
        """Record the scale after an ``update()``; True when that iteration's step was skipped."""
        previous, self._last = self._last, scale
        if previous is not None and scale < previous:
            self.skipped += 1
            self.consecutive_skips += 1
            return True
        self.consecutive_skips = 0
        return False

    @property
    def scale(self) -> float | None:
        return self._last


class AmpScale:
    """Plug-in: ``stabmon_amp_loss_scale``, ``stabmon_amp_skipped_steps_total``, ``amp_skip``
    records, and the anomaly for a run of skips."""

    component = "detectors"

    def __init__(self, context: Context) -> None:
        self._context = context
        self._readings = context.readings
        self._skip_run = context.config.amp_skip_run
        self._tracker = ScaleTracker()

    def scale_judged(self, step: int, scale: float) -> None:
        readings = self._readings
        readings.amp_loss_scale = scale
        if not self._tracker.update(scale):
            return
        readings.amp_skipped_steps = (readings.amp_skipped_steps or 0) + 1
        run = self._tracker.consecutive_skips
        self._context.event("amp_skip", step=step, scale=scale, consecutive=run)
        if run == self._skip_run:  # once per run of skips
            self._context.anomaly(
                "nonfinite_grad",
                step,
                f"GradScaler skipped {run} optimizer steps in a row at step {step} (loss "
                f"scale now {scale:g}): the gradients are Inf/NaN at every scale it tries, "
                "so the model has stopped training",
                source="amp_skip_run",
                consecutive=run,
                scale=scale,
            )
