"""The extension point: a probe or detector is one class, plugged into the Monitor in one place.

In the spirit of client_python's ``Collector`` and Lightning's ``Callback``: a plug-in
implements the hooks it needs, of the five below, and is listed once, as a factory, in
:data:`stabmon.plugins.PLUGINS`. At attach the Monitor calls each factory with the
:class:`Attachment` (a factory returns None when its feature is configured off) and
sorts what they return into one tuple per hook, so a hook costs nothing for plug-ins
that do not implement it. Example (the whole of a probe that publishes a metric;
docs/architecture.md, "Adding a probe", has the diff that adds it)::

    class LearningRate:
        component = "exporter"       # its failures count in stabmon_internal_errors_total

        def __init__(self, attachment: Attachment) -> None:
            self._optimizer = attachment.optimizer

        def readings(self) -> Iterable[Reading]:
            groups = self._optimizer.param_groups
            yield LEARNING_RATE, [((str(i),), float(g["lr"])) for i, g in enumerate(groups)]

The hooks, each optional, each call contained by the guard under ``component``:

- ``step_end(steps)``: training thread, after an optimizer step, once ``steps`` (steps
  completed in this process) reaches the plug-in's ``next_step``; the Monitor compares
  one integer a step, the smallest ``next_step`` of all, re-read after each call.
- ``epoch_end(step)``: training thread, at an epoch boundary, after memory was judged.
  ``step`` is the index of the epoch's last step, across resumes, as its ``epoch``
  record names it (docs/steps.md): after ``n`` steps, ``n - 1``; None before the first.
- ``grads_judged(step, summary)``: whichever thread judges read-back results, under the
  judging lock, once per measured step's :class:`~stabmon.probes.grads.GradSummary`;
  ``step`` is the index of the measured step.
- ``readings()``: the exporter thread, at scrape: ``(contract row, samples)`` pairs,
  each sample ``(label values, value)``; the ``rank`` and ``run`` labels are added.
- ``detach()``: once, at ``Monitor.detach()``, before the threads stop.

This module imports nothing from stabmon at run time (a checked leaf): the types
below are for readers and mypy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from stabmon.config import Config
    from stabmon.contract import MetricDef
    from stabmon.judging import Judging
    from stabmon.log import LogLimiter
    from stabmon.probes.grads import GradSummary
    from stabmon.probes.heartbeat import Heartbeat
    from stabmon.probes.memory import MemorySampler
    from stabmon.readings import Readings
    from stabmon.recorder import Recorder

__all__ = [
    "Attachment",
    "Detaches",
    "EpochEnd",
    "GradsJudged",
    "Plugin",
    "Publishes",
    "Reading",
    "StepEnd",
]

#: One metric's samples at a scrape: its contract row and (label values, value) pairs.
Reading = tuple["MetricDef", Iterable[tuple[Sequence[str], float]]]


@dataclass(frozen=True)
class Attachment:
    """What a plug-in may use, handed to its factory at attach (everything is the Monitor's)."""

    config: Config
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    readings: Readings
    #: Judges, counts and writes events (hold ``judging`` to call it from another thread).
    recorder: Recorder
    limiter: LogLimiter
    memory: MemorySampler
    heartbeat: Heartbeat
    #: The judging engine (stabmon.judging): use the recorder under ``judging.lock``.
    judging: Judging[Any]
    run_directory: Path
    rank: int


class Plugin(Protocol):
    """Any plug-in: the guard component its failures are counted against."""

    #: One of stabmon.contract.INTERNAL_COMPONENTS (a bounded label).
    component: str


@runtime_checkable
class StepEnd(Protocol):
    component: str
    #: Steps completed in this process at which step_end next runs.
    next_step: int

    def step_end(self, steps: int) -> None: ...


@runtime_checkable
class EpochEnd(Protocol):
    component: str

    def epoch_end(self, step: int | None) -> None: ...


@runtime_checkable
class GradsJudged(Protocol):
    component: str

    def grads_judged(self, step: int, summary: GradSummary) -> None: ...


@runtime_checkable
class Publishes(Protocol):
    component: str

    def readings(self) -> Iterable[Reading]: ...


@runtime_checkable
class Detaches(Protocol):
    component: str

    def detach(self) -> None: ...
