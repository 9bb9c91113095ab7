"""Non-finite gradients and losses: one anomaly per episode, every bad step counted.

A poisoned model is non-finite at every step from its first bad one; a record per step
would flood the event log and page once per step. So each plug-in here counts every
non-finite value (``stabmon_nonfinite_grad_steps_total``, ``stabmon_nonfinite_losses_total``),
records an anomaly at an episode's first step naming the module groups and parameters,
and an ``<kind>_end`` record when the episode ends (``spike_episode_gap`` good values in a
row, or the last judgement at detach or exit).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stabmon.detectors.episodes import EpisodeChange, Episodes

if TYPE_CHECKING:
    from stabmon.extension import Context
    from stabmon.probes.grads import GradSummary

__all__ = ["NonfiniteGrads", "NonfiniteLoss", "episode_end", "named"]

#: Parameters a message names at most (the event record holds up to 20).
NAMED_PARAMETERS = 5


def named(parameters: list[str], what: str = "parameters") -> str:
    """`` (<what> a, b and 3 more)`` for a message; empty without parameters."""
    if not parameters:
        return ""
    shown = ", ".join(parameters[:NAMED_PARAMETERS])
    more = len(parameters) - NAMED_PARAMETERS
    return f" ({what} {shown}{f' and {more} more' if more > 0 else ''})"


def episode_end(context: Context, kind: str, change: EpisodeChange, **details: Any) -> None:
    """The ``<kind>_end`` record of an episode that just ended."""
    context.event(
        f"{kind}_end",
        step=change.last_step,
        first_step=change.first_step,
        last_step=change.last_step,
        count=change.count,
        **details,
    )


class NonfiniteGrads:
    """Plug-in: a measured step whose gradient norm is NaN or Inf."""

    component = "detectors"

    def __init__(self, context: Context) -> None:
        self._context = context
        self._readings = context.readings
        self._episodes = Episodes(context.config.spike_episode_gap)
        self._groups: set[str] = set()

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        change = self._episodes.update(step, bad=summary.nonfinite)
        if not summary.nonfinite:
            if change is not None:
                episode_end(self._context, "nonfinite_grad", change, modules=sorted(self._groups))
            return
        self._readings.nonfinite_grad_steps += 1
        # In model order (the groups' order), so the first named is nearest the input.
        groups = [group for group, norm in summary.group_norms.items() if not math.isfinite(norm)]
        if change is None:  # the episode goes on: one record for all of it
            self._groups.update(groups)
            return
        self._groups = set(groups)
        names = summary.layout.nonfinite_offenders(summary)
        action = self._context.config.on_anomaly.nonfinite_grad
        weights = (
            f"on_anomaly.nonfinite_grad: {action} acts on it (its policy record says whether "
            "the step was held back)"
            if action in ("skip", "stop")
            else "resume from a checkpoint before it if the weights went non-finite too "
            "(on_anomaly.nonfinite_grad: skip holds such steps back)"
        )
        self._context.anomaly(
            "nonfinite_grad",
            step,
            f"non-finite gradient norm {summary.total_norm} at step {step} in module "
            f"group(s) {', '.join(groups) or 'unknown'}{named(names, 'first parameters')}; "
            f"look at step {step}'s batch and learning rate; {weights}; further non-finite "
            "steps of this episode are counted, not recorded again",
            grad_norm=summary.total_norm,
            modules=groups,
            parameters=names,
        )

    def finish(self) -> None:
        change = self._episodes.close()
        if change is not None:
            episode_end(self._context, "nonfinite_grad", change, modules=sorted(self._groups))


class NonfiniteLoss:
    """Plug-in: an observed training loss that is NaN or Inf."""

    component = "detectors"

    def __init__(self, context: Context) -> None:
        self._context = context
        self._readings = context.readings
        self._episodes = Episodes(context.config.spike_episode_gap)

    def loss_judged(self, step: int, value: float) -> None:
        finite = math.isfinite(value)
        change = self._episodes.update(step, bad=not finite)
        if finite:
            if change is not None:
                episode_end(self._context, "nonfinite_loss", change)
            return
        self._readings.nonfinite_losses += 1
        if change is not None:
            self._context.anomaly(
                "nonfinite_loss",
                step,
                f"non-finite loss {value} at step {step}; further non-finite losses of this "
                "episode are counted, not recorded again",
                loss=value,
            )

    def finish(self) -> None:
        change = self._episodes.close()
        if change is not None:
            episode_end(self._context, "nonfinite_loss", change)
