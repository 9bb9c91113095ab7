"""Every probe and detector plugged into the Monitor: the one list, and its per-hook tuples.

Adding a probe is one class (see :mod:`stabmon.extension` for the hooks) and one line in
:data:`PLUGINS`; a metric it publishes is one more row in :mod:`stabmon.contract`.
docs/architecture.md ("Adding a probe") shows the whole diff.

Design
------
At attach :class:`Plugged` sorts the plug-ins into one tuple per hook, so the Monitor
never asks a plug-in whether it has something to do: the training thread's step end
compares one integer (:attr:`Plugged.next_step`, the smallest ``next_step`` of the
``step_end`` plug-ins) and calls into this module only when one is due. Each call is
contained by the guard, under the plug-in's ``component``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from stabmon.detectors.dead import DeadGradientJudge
from stabmon.extension import (
    Attachment,
    Detaches,
    EpochEnd,
    GradsJudged,
    Publishes,
    StepEnd,
)
from stabmon.guard import Guard
from stabmon.probes.grads import GradSummary
from stabmon.probes.memory import TrendSampler
from stabmon.probes.memory_snapshot import AllocatorSnapshots

__all__ = ["PLUGINS", "Plugged"]

#: Builds a plug-in from the Attachment at attach (or returns None: configured off).
Factory = Callable[[Attachment], Any]

#: Every plug-in of every Monitor, in the order each hook calls them.
PLUGINS: tuple[Factory, ...] = (
    AllocatorSnapshots,
    TrendSampler,
    DeadGradientJudge,
)


class Plugged:
    """The plug-ins of one Monitor, sorted by hook at attach."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._step_end: tuple[StepEnd, ...] = ()
        self._epoch_end: tuple[EpochEnd, ...] = ()
        self._grads_judged: tuple[GradsJudged, ...] = ()
        self._detach: tuple[Detaches, ...] = ()
        #: The plug-ins that publish metrics (each gets a collector in the registry).
        self.publishing: tuple[Publishes, ...] = ()
        #: Steps completed at which a step_end plug-in is next due (read every step).
        self.next_step = sys.maxsize

    def plug(self, attachment: Attachment, factories: Sequence[Factory] | None = None) -> None:
        """Build every plug-in of ``factories`` (default :data:`PLUGINS`; one that fails to
        build is left out, counted) and sort them by hook."""
        plugins = []
        for factory in PLUGINS if factories is None else factories:
            with self._guard.contain("hooks"):
                plugin = factory(attachment)
                if plugin is not None:
                    plugins.append(plugin)
        self._step_end = tuple(p for p in plugins if isinstance(p, StepEnd))
        self._epoch_end = tuple(p for p in plugins if isinstance(p, EpochEnd))
        self._grads_judged = tuple(p for p in plugins if isinstance(p, GradsJudged))
        self._detach = tuple(p for p in plugins if isinstance(p, Detaches))
        self.publishing = tuple(p for p in plugins if isinstance(p, Publishes))
        self.next_step = self._next_step()

    def step_end(self, steps: int) -> None:
        for plugin in self._step_end:
            if steps >= plugin.next_step:
                try:
                    plugin.step_end(steps)
                except Exception as error:
                    self._guard.record(plugin.component, error)
        self.next_step = self._next_step()

    def epoch_end(self, step: int | None) -> None:
        for plugin in self._epoch_end:
            try:
                plugin.epoch_end(step)
            except Exception as error:
                self._guard.record(plugin.component, error)
        self.next_step = self._next_step()

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        for plugin in self._grads_judged:
            try:
                plugin.grads_judged(step, summary)
            except Exception as error:
                self._guard.record(plugin.component, error)

    def detach(self) -> None:
        for plugin in self._detach:
            try:
                plugin.detach()
            except Exception as error:
                self._guard.record(plugin.component, error)

    def _next_step(self) -> int:
        return min((plugin.next_step for plugin in self._step_end), default=sys.maxsize)
