"""The compact ``step_sample`` record every ``sample_every`` steps, for ``stabmon report``.

Fed on the host by the Recorder as read-back values arrive; the event log writes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from stabmon.pipeline.readings import Readings

__all__ = ["MAX_MARKS", "StepSampler"]

#: Window marks kept for samples not yet written; when they are full the Monitor judges what
#: waits (a batch of results then spans at most this many sample windows).
MAX_MARKS = 64


class StepSampler:
    """Builds one compact ``step_sample`` record every ``every`` steps, for ``stabmon report``.

    Design: it is fed on the host, where read-back values arrive (the recorder's
    ``grads`` and ``loss``), never in a hook, so the step itself does no extra
    work; between samples a call is one comparison. A step's gradient norms and
    its loss arrive separately (either first), so the record for the first step
    at or past each multiple of ``every`` is written once both have come, or
    when a later step's value arrives (a loop that observes no loss, or measures
    gradients every few steps). Fields a step did not measure are the latest
    readings. Step time and input wait are means over the steps of the sample's
    window (``every`` steps), from the histograms' sums marked when the window's
    first step ends (:meth:`close_window`, one comparison per step on the hot
    path): values are judged in batches, so a record may be written many steps
    after its step. Size is bounded: module norms are at most ``max_modules`` groups.
    """

    def __init__(
        self, every: int, readings: Readings, write: Callable[..., None], *, digits: int = 6
    ) -> None:
        self.every = every
        self._readings = readings
        self._write = write
        self._digits = digits
        #: The first step whose values matter: the pending sample's, else the next sample's.
        #: Callers on the hot path compare with it before calling (one comparison per step).
        self.due = 0
        self._next = 0
        self._pending: dict[str, Any] | None = None
        #: The global step whose end closes the next window: callers compare with it at each
        #: step end and then call :meth:`close_window`.
        self.window_due = 0
        # Window number -> (count, sum) of the step-duration and input-wait histograms when its
        # first step ended; a few windows at most wait for their samples.
        self._marks: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
        self._steps_seen = (0.0, 0.0)  # the marks the last sample's means ended at
        self._waits_seen = (0.0, 0.0)

    def grads(self, step: int, total_norm: float, module_norms: Mapping[str, float]) -> None:
        if step < self.due:
            return
        pending = self._open(step)
        if pending is not None:
            pending["grad_norm"] = total_norm
            pending["module_grad_norms"] = dict(module_norms)
            if "loss" in pending:
                self.flush()

    def loss(self, step: int, value: float) -> None:
        if step < self.due:
            return
        pending = self._open(step)
        if pending is not None:
            pending["loss"] = value
            if "grad_norm" in pending:
                self.flush()

    def close_window(self, step: int) -> bool:
        """Global step ``step`` just ended, the first to end in its window: mark the sums.

        Returns True when the marks are full: the caller should judge what waits now.
        """
        readings = self._readings
        window = step // self.every
        self._marks[window] = (readings.step_duration.totals(), readings.data_wait.totals())
        if len(self._marks) > MAX_MARKS:
            del self._marks[min(self._marks)]  # its sample: no step time rather than a wrong one
        self.window_due = (window + 1) * self.every
        return len(self._marks) >= MAX_MARKS

    def flush(self) -> None:
        """Write the pending sample, if any (also at detach, so the last one is kept)."""
        pending, self._pending = self._pending, None
        self.due = self._next
        if pending is None:
            return
        readings = self._readings
        pending.setdefault("loss", readings.loss)
        pending.setdefault("grad_norm", readings.grad_norm)
        pending.setdefault("module_grad_norms", dict(readings.module_grad_norms))
        window = pending["step"] // self.every
        mark = self._marks.pop(window, None)
        for older in [number for number in self._marks if number < window]:
            del self._marks[older]
        if mark is None and not self._marks:  # the step has not ended (a loss observed in it)
            mark = (readings.step_duration.totals(), readings.data_wait.totals())
        if mark is None:  # its mark was dropped: no figure rather than a later window's
            pending["step_seconds"] = pending["data_wait_seconds"] = None
        else:
            pending["step_seconds"], self._steps_seen = _window_mean(mark[0], self._steps_seen)
            pending["data_wait_seconds"], self._waits_seen = _window_mean(mark[1], self._waits_seen)
        pending["epoch"] = readings.epoch
        if readings.amp_loss_scale is not None:
            pending["amp_loss_scale"] = readings.amp_loss_scale
        if readings.device_utilization:
            pending["gpu_utilization"] = dict(readings.device_utilization)
        if readings.host_rss is not None:
            pending["host_rss_bytes"] = readings.host_rss
        self._write("step_sample", **_rounded(pending, self._digits))

    def _open(self, step: int) -> dict[str, Any] | None:
        pending = self._pending
        if pending is not None and pending["step"] != step:
            self.flush()
            pending = None
        if pending is None:
            if step < self._next:
                return None
            pending = self._pending = {"step": step}
            self._next = (step // self.every + 1) * self.every
            self.due = step
        return pending


def _window_mean(
    totals: tuple[float, float], seen: tuple[float, float]
) -> tuple[float | None, tuple[float, float]]:
    """Mean of the observations between two marks (a histogram's count and sum), and the mark."""
    count, total = totals
    delta = count - seen[0]
    mean = (total - seen[1]) / delta if delta > 0 else None
    return mean, totals


def _rounded(value: Any, digits: int) -> Any:
    """Floats cut to ``digits`` significant digits: a plot needs no more, the log stays small."""
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {key: _rounded(item, digits) for key, item in value.items()}
    return value
