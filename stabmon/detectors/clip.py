"""The clip coefficient: what the loop's ``clip_grad_norm_`` multiplied the gradients by.

The clip's ``max_norm`` (seen by the clip watch, :mod:`stabmon.probes.clipping`) and the
pre-clip total norm of the same step (from the gradient probe) arrive in either order: a
plain loop clips before its step is measured, Lightning after. Each step is judged once
both are known; a measured step without a clip of its own reads 1.0 until one comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stabmon.extension import Context
    from stabmon.probes.grads import GradSummary

__all__ = ["ClipCoefficient"]


class ClipCoefficient:
    """Plug-in: ``stabmon_grad_clip_coefficient`` and ``stabmon_grad_clipped_steps_total``."""

    component = "detectors"

    def __init__(self, context: Context) -> None:
        self._readings = context.readings
        self._limit: tuple[int, float] | None = None
        self._measured: tuple[int, float] | None = None
        self._judged = -1

    def clip_judged(self, step: int, max_norm: float) -> None:
        self._limit = (step, max_norm)
        self._judge()

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        if summary.nonfinite:
            return
        self._measured = (step, summary.total_norm)
        self._judge()

    def _judge(self) -> None:
        limit, measured = self._limit, self._measured
        if measured is None:
            return
        step, total = measured
        if step == self._judged:
            return
        readings = self._readings
        if limit is None or limit[0] != step:
            readings.grad_clip_coefficient = 1.0  # not clipped (yet: a later clip may say so)
            return
        self._judged = step
        # What torch's clip_grad_norm_ multiplies the gradients by.
        coefficient = min(1.0, limit[1] / (total + 1e-6))
        readings.grad_clip_coefficient = coefficient
        if coefficient < 1.0:
            readings.grad_clipped_steps += 1
