"""Dead branches: trainable parameters whose gradient stays exactly zero for a window.

A loss branch that GradScaler, a ``detach()`` or a wrong mask cuts off still
trains without an error: its parameters just never move. The count of zero
gradients (``stabmon_zero_grad_params``) shows that something is zero; this
detector says which module, once the gradient has been exactly zero (or None)
at every measured step of a window, so a branch used only every other step or
a ReLU that is briefly all-off is not reported.

It is fed the per-tensor norms the gradient probe reads back anyway. Steps
without a zero gradient cost one check; the per-parameter bookkeeping runs only
while some gradient is zero.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stabmon.detectors.nonfinite import named

if TYPE_CHECKING:
    from stabmon.extension import Context
    from stabmon.probes.grads import GradLayout, GradSummary

__all__ = ["DeadGradientJudge", "DeadGradients", "DeadReport", "module_of"]


def module_of(param_name: str) -> str:
    """The module that owns a parameter (``head.aux.weight`` -> ``head.aux``; root: ``""``)."""
    return param_name.rpartition(".")[0]


@dataclass(frozen=True)
class DeadReport:
    """What changed at one measured step."""

    #: Parameters that just completed a window of zero gradients.
    newly_dead: tuple[str, ...]
    #: Dead parameters whose gradient is nonzero again.
    revived: tuple[str, ...]


_NOTHING_CHANGED = DeadReport((), ())


class DeadGradients:
    """Follows which parameters' gradients have been zero for ``window`` measured steps.

    ``names`` and ``groups`` give each position of the norms handed to
    :meth:`update` its parameter name and module group (the exported ``module``
    label), in the probe's packed order.
    """

    def __init__(self, names: Sequence[str], groups: Sequence[str], window: int) -> None:
        if len(names) != len(groups):
            raise ValueError("names and groups must have one entry per parameter")
        self._names = tuple(names)
        self._groups = tuple(groups)
        self._window = window
        self._measured = 0
        self._zero_since: dict[int, int] = {}
        self._dead: set[int] = set()

    def update(self, tensor_norms: Sequence[float], zero_count: int) -> DeadReport:
        """One measured step's per-tensor norms (``zero_count`` of them exactly 0.0)."""
        self._measured += 1
        if zero_count == 0 and not self._zero_since:
            return _NOTHING_CHANGED  # the usual step: nothing built
        zeros = (
            {index for index, norm in enumerate(tensor_norms) if norm == 0.0}
            if zero_count
            else set()
        )
        revived = sorted(index for index in self._dead if index not in zeros)
        self._dead.difference_update(revived)
        for index in [index for index in self._zero_since if index not in zeros]:
            del self._zero_since[index]
        newly_dead = []
        for index in sorted(zeros):
            since = self._zero_since.setdefault(index, self._measured)
            if index not in self._dead and self._measured - since + 1 >= self._window:
                self._dead.add(index)
                newly_dead.append(index)
        return DeadReport(
            tuple(self._names[index] for index in newly_dead),
            tuple(self._names[index] for index in revived),
        )

    def dead_by_group(self) -> dict[str, int]:
        """Dead parameters per module group, every group present (0 where none is dead)."""
        counts = dict.fromkeys(self._groups, 0)
        for index in self._dead:
            counts[self._groups[index]] += 1
        return counts


class DeadGradientJudge:
    """Plug-in (:mod:`stabmon.extension`): feeds each judged gradient summary to
    :class:`DeadGradients`; a new layout (model moved, parameters changed) restarts it.

    A module group newly dead is a ``dead_grad`` anomaly (one per episode); every newly dead
    or revived parameter is a ``dead_gradients`` / ``gradients_revived`` record.
    """

    component = "detectors"

    def __init__(self, context: Context) -> None:
        self._context = context
        self._window = context.config.dead_grad_steps
        self._readings = context.readings
        self._dead: DeadGradients | None = None
        self._layout: GradLayout | None = None  # the layout self._dead was built for

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        layout = summary.layout
        empty_shards = layout.empty_shards
        dead = self._dead
        if dead is None or self._layout is not layout:
            empty = set(empty_shards)
            names = [n for i, n in enumerate(layout.names) if i not in empty]
            groups = [g for i, g in enumerate(layout.packed_groups) if i not in empty]
            dead = self._dead = DeadGradients(names, groups, self._window)
            self._layout = layout
        norms = summary.tensor_norms
        if empty_shards:
            empty = set(empty_shards)
            norms = [n for i, n in enumerate(norms) if i not in empty]
        report = dead.update(norms, summary.zero_grad_params)
        if report.newly_dead or report.revived or not self._readings.dead_grad_params:
            self._record(step, report, dead.dead_by_group())

    def _record(self, step: int, report: DeadReport, by_group: Mapping[str, int]) -> None:
        """Dead branches: name the modules whose gradients stayed exactly zero for a window."""
        before = {group for group, count in self._readings.dead_grad_params.items() if count}
        self._readings.dead_grad_params = dict(by_group)
        if report.newly_dead:
            self._newly_dead(step, report, by_group, before)
        if report.revived:
            self._context.event(
                "gradients_revived", step=step, parameters=list(report.revived[:20])
            )

    def _newly_dead(
        self, step: int, report: DeadReport, by_group: Mapping[str, int], before: set[str]
    ) -> None:
        context, window = self._context, self._window
        modules = sorted({module_of(name) or "(root)" for name in report.newly_dead})
        groups = sorted(group for group, count in by_group.items() if count)
        if set(groups) - before:  # a module group newly dead: one anomaly per episode
            context.anomaly(
                "dead_grad",
                step,
                f"gradients of module group(s) {', '.join(groups)} have been exactly zero "
                f"for {window} measured steps at step {step}"
                f"{named(list(report.newly_dead))}: a branch cut off by detach(), a mask, an "
                "unused output, a loss term that is always zero, or under AMP a branch whose "
                "half-precision gradients underflow to zero",
                modules=groups,
                parameters=list(report.newly_dead[:20]),
            )
        context.event(
            "dead_gradients",
            step=step,
            modules=modules[:20],
            parameters=list(report.newly_dead[:20]),
            count=len(report.newly_dead),
        )
        context.log(
            "dead_gradients",
            logging.WARNING,
            "stabmon: the gradient of %s has been exactly zero for %d measured steps "
            "(parameters %s): a dead branch, cut off by detach(), a mask, an unused output "
            "or a loss term that is always zero",
            ", ".join(modules[:5]) + (f" and {len(modules) - 5} more" if len(modules) > 5 else ""),
            window,
            ", ".join(report.newly_dead[:5]),
        )
