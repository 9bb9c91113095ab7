"""Every plug-in of a Monitor: the built-in list, and the per-hook tuples the pipeline calls.

Adding a probe is one class (see :mod:`stabmon.extension` for the hooks) and one line in
:data:`PLUGINS`, or, outside stabmon, ``attach(..., plugins=[MyProbe])``; a metric it
publishes is one more row in :mod:`stabmon.contract`. docs/architecture.md ("Adding a
probe") shows the whole diff of a device-side probe.

Design
------
At attach :class:`Plugged` sorts the plug-ins into one tuple per hook, so the pipeline
never asks a plug-in whether it has something to do: the training thread's step end
compares one integer (:attr:`Plugged.next_step`, the smallest ``next_step`` of the
``step_end`` plug-ins) and calls into this module only when one is due; the device-side
hooks cost one truth test of an empty tuple a step when no plug-in measures. Each call
is contained by the guard, under the plug-in's ``component``.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stabmon.detectors.amp import AmpScale
from stabmon.detectors.clip import ClipCoefficient
from stabmon.detectors.dead import DeadGradientJudge
from stabmon.detectors.leak_rules import MemoryLeaks
from stabmon.detectors.nonfinite import NonfiniteGrads, NonfiniteLoss
from stabmon.detectors.replica import ReplicaCheck
from stabmon.detectors.spike_rules import GradSpikes, LossSpikes
from stabmon.detectors.starvation import InputStarvation
from stabmon.errors import AnomalyStop, StabmonError
from stabmon.extension import (
    RESERVED_STATE_KEYS,
    AnomalyRecorded,
    CheckpointSaved,
    ClipJudged,
    Context,
    Detaches,
    EpochEnd,
    EpochMemory,
    Factory,
    Finishes,
    GatesStep,
    GradsJudged,
    LossJudged,
    MeasuresOnDevice,
    Publishes,
    ScaleJudged,
    Stateful,
    StepEnd,
)
from stabmon.policies.plugin import anomaly_policies
from stabmon.probes.grads import GradSummary
from stabmon.probes.memory_snapshot import AllocatorSnapshots
from stabmon.probes.provenance import NanProvenance
from stabmon.probes.replicas import ReplicaProbe
from stabmon.shared.guard import Guard

__all__ = ["PLUGINS", "DeviceJudge", "Plugged"]


def replica_check(context: Context) -> ReplicaCheck | None:
    """The replica check: its probe measures on the device, the detector judges the vote."""
    probe = ReplicaProbe.create(context)
    return None if probe is None else ReplicaCheck(probe, context)


#: Every built-in plug-in of every Monitor, in the order each hook calls them. Order
#: matters where verdicts build on each other: a non-finite episode's end is recorded
#: before a spike of the same step, and the clip's limit is known to the spike rule.
PLUGINS: tuple[Factory, ...] = (
    NonfiniteGrads,
    NonfiniteLoss,
    NanProvenance,
    replica_check,
    ClipCoefficient,
    GradSpikes,
    LossSpikes,
    AmpScale,
    MemoryLeaks,
    AllocatorSnapshots,
    DeadGradientJudge,
    InputStarvation,
    anomaly_policies,  # last: acts on what the judges before it recorded
)

#: Read in C by Plugged._refresh, after every judged result.
_NEXT_STEP = operator.attrgetter("next_step")
_MEASURING = operator.attrgetter("measuring")

#: Submits a device result to the readback queue: (judge, step, tensor).
Submit = Callable[["DeviceJudge", int, torch.Tensor], None]


class DeviceJudge:
    """Hands one device plug-in's read-back values to its ``judge``, contained.

    Built once per plug-in at attach and carried in each result's tag, so the readback's
    consumer calls every result the same way, whatever measured it.
    """

    __slots__ = ("_guard", "_plugin")

    def __init__(self, plugin: MeasuresOnDevice, guard: Guard) -> None:
        self._plugin, self._guard = plugin, guard

    def __call__(self, step: int, values: list[float], extra: object) -> None:
        try:
            self._plugin.judge(step, values)
        except Exception as error:
            self._guard.record(self._plugin.component, error)


#: A plug-in's hook, bound once at attach, and the component its failures count against.
_Bound = tuple[Callable[..., Any], str]


def _bound(plugins: Sequence[Any], protocol: type, hook: str) -> tuple[_Bound, ...]:
    """``hook`` of each plug-in that implements ``protocol``, bound, with its component."""
    found: list[Any] = [plugin for plugin in plugins if isinstance(plugin, protocol)]
    return tuple((getattr(plugin, hook), plugin.component) for plugin in found)


def _call(guard: Guard, hooks: tuple[_Bound, ...], *args: object) -> None:
    """Call each bound hook, each call contained under its plug-in's component."""
    for hook, component in hooks:
        try:
            hook(*args)
        except Exception as error:
            guard.record(component, error)


class Plugged:
    """The plug-ins of one Monitor, sorted by hook at attach."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self.plugins: tuple[Any, ...] = ()
        self._before_step: tuple[tuple[MeasuresOnDevice, DeviceJudge], ...] = ()
        self._after_step: tuple[tuple[MeasuresOnDevice, DeviceJudge], ...] = ()
        self._grads_judged: tuple[_Bound, ...] = ()
        self._loss_judged: tuple[_Bound, ...] = ()
        self._clip_judged: tuple[_Bound, ...] = ()
        self._scale_judged: tuple[_Bound, ...] = ()
        self._anomaly_recorded: tuple[_Bound, ...] = ()
        self._step_end: tuple[StepEnd, ...] = ()
        self._gates: tuple[GatesStep, ...] = ()
        self._checkpoint_saved: tuple[_Bound, ...] = ()
        #: Whether a plug-in gates the optimizer step (read every step).
        self.gates = False
        self._epoch_end: tuple[_Bound, ...] = ()
        self._epoch_memory: tuple[EpochMemory, ...] = ()
        self._stateful: tuple[Stateful, ...] = ()
        self._finish: tuple[_Bound, ...] = ()
        self._detach: tuple[_Bound, ...] = ()
        #: The plug-ins that publish metrics (each gets a collector in the registry).
        self.publishing: tuple[Publishes, ...] = ()
        #: Whether a plug-in measures on the device before / after each optimizer step.
        self.measures_before = self.measures_after = False
        #: The device plug-ins with a ``measuring`` attribute, and whether one without it (one
        #: that always measures) is plugged: set at attach, read by _refresh.
        self._watch_before: tuple[MeasuresOnDevice, ...] = ()
        self._watch_after: tuple[MeasuresOnDevice, ...] = ()
        self._always_before = self._always_after = False
        #: Steps completed at which a step_end plug-in is next due (read every step).
        self.next_step = sys.maxsize

    def plug(
        self,
        context: Context,
        factories: Sequence[Factory] | None = None,
        *,
        extra: Sequence[Factory] = (),
    ) -> None:
        """Build every plug-in of ``factories`` (default :data:`PLUGINS`) and then ``extra``
        (the user's), and sort them by hook; one that fails to build is left out, counted."""
        plugins = []
        for factory in (*(PLUGINS if factories is None else factories), *extra):
            with self._guard.contain("hooks"):
                plugin = factory(context)
                if plugin is not None:
                    plugins.append(plugin)
        self.plugins = tuple(plugins)
        self._sort(plugins)

    def _sort(self, plugins: list[Any]) -> None:
        device = [p for p in plugins if isinstance(p, MeasuresOnDevice)]
        self._before_step = tuple(
            (p, DeviceJudge(p, self._guard)) for p in device if p.measure_at == "before_step"
        )
        self._after_step = tuple(
            (p, DeviceJudge(p, self._guard)) for p in device if p.measure_at != "before_step"
        )
        # Which device plug-ins say whether they measure now (``measuring``); one that does
        # not always measures.
        before = [p for p, _ in self._before_step]
        after = [p for p, _ in self._after_step]
        self._watch_before = tuple(p for p in before if hasattr(p, "measuring"))
        self._watch_after = tuple(p for p in after if hasattr(p, "measuring"))
        self._always_before = len(self._watch_before) < len(before)
        self._always_after = len(self._watch_after) < len(after)
        self._grads_judged = _bound(plugins, GradsJudged, "grads_judged")
        self._loss_judged = _bound(plugins, LossJudged, "loss_judged")
        self._clip_judged = _bound(plugins, ClipJudged, "clip_judged")
        self._scale_judged = _bound(plugins, ScaleJudged, "scale_judged")
        self._anomaly_recorded = _bound(plugins, AnomalyRecorded, "anomaly_recorded")
        self._step_end = tuple(p for p in plugins if isinstance(p, StepEnd))
        self._gates = tuple(p for p in plugins if isinstance(p, GatesStep))
        self.gates = bool(self._gates)
        self._checkpoint_saved = _bound(plugins, CheckpointSaved, "checkpoint_saved")
        self._epoch_end = _bound(plugins, EpochEnd, "epoch_end")
        self._epoch_memory = tuple(p for p in plugins if isinstance(p, EpochMemory))
        self._stateful = tuple(p for p in plugins if isinstance(p, Stateful))
        self._finish = _bound(plugins, Finishes, "finish")
        self._detach = _bound(plugins, Detaches, "detach")
        self.publishing = tuple(p for p in plugins if isinstance(p, Publishes))
        self._refresh()
        keys = [p.state_key for p in self._stateful]
        clashes = sorted({k for k in keys if keys.count(k) > 1 or k in RESERVED_STATE_KEYS})
        if clashes:
            raise StabmonError(
                f"plug-ins share the state key(s) {', '.join(clashes)} (or use one the Monitor "
                f"reserves: {', '.join(RESERVED_STATE_KEYS)}); give each plug-in its own "
                "state_key"
            )

    # --- the training thread ------------------------------------------------------------------

    def measure_before(self, step: int, submit: Submit) -> None:
        self._measure(self._before_step, step, submit)
        self._refresh()

    def measure_after(self, step: int, submit: Submit) -> None:
        self._measure(self._after_step, step, submit)
        self._refresh()

    def _measure(
        self, plugins: tuple[tuple[MeasuresOnDevice, DeviceJudge], ...], step: int, submit: Submit
    ) -> None:
        for plugin, judge in plugins:
            try:
                values = plugin.measure(step)
                if values is not None:
                    submit(judge, step, values)
            except Exception as error:
                self._guard.record(plugin.component, error)

    def gate_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Each gate's ``gate_step``, contained; :class:`AnomalyStop` alone is raised on."""
        for plugin in self._gates:
            try:
                plugin.gate_step(step, optimizer)
            except AnomalyStop:
                raise  # on_anomaly asked for it, on every rank at this step
            except Exception as error:
                self._guard.record(plugin.component, error)

    def step_applied(self) -> None:
        for plugin in self._gates:
            try:
                plugin.step_applied()
            except Exception as error:
                self._guard.record(plugin.component, error)

    def checkpoint_saved(self, step: int | None, path: str | None, completed: bool) -> None:
        _call(self._guard, self._checkpoint_saved, step, path, completed)

    def step_end(self, steps: int) -> None:
        for plugin in self._step_end:
            if steps >= plugin.next_step:
                try:
                    plugin.step_end(steps)
                except Exception as error:
                    self._guard.record(plugin.component, error)
        self.next_step = self._next_step()

    def epoch_memory(self, samples: Mapping[str, float]) -> dict[str, float | None]:
        """The epoch-end memory samples to each judge; the drift by label they return."""
        drift: dict[str, float | None] = {}
        for plugin in self._epoch_memory:
            try:
                drift.update(plugin.epoch_memory(samples))
            except Exception as error:
                self._guard.record(plugin.component, error)
        return drift

    def epoch_end(self, step: int | None) -> None:
        _call(self._guard, self._epoch_end, step)
        self.next_step = self._next_step()

    # --- under the judging lock ---------------------------------------------------------------

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        _call(self._guard, self._grads_judged, step, summary)
        self._refresh()  # a verdict may arm a measurement or ask for a step end

    def loss_judged(self, step: int, value: float) -> None:
        _call(self._guard, self._loss_judged, step, value)
        self._refresh()

    def clip_judged(self, step: int, max_norm: float) -> None:
        _call(self._guard, self._clip_judged, step, max_norm)

    def scale_judged(self, step: int, scale: float) -> None:
        _call(self._guard, self._scale_judged, step, scale)

    def anomaly_recorded(self, kind: str, step: int | None) -> None:
        _call(self._guard, self._anomaly_recorded, kind, step)

    def finish(self) -> None:
        _call(self._guard, self._finish)

    def detach(self) -> None:
        _call(self._guard, self._detach)

    # --- resume ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {plugin.state_key: plugin.state_dict() for plugin in self._stateful}

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The keys the plug-ins' states take in Monitor.state_dict()."""
        return tuple(plugin.state_key for plugin in self._stateful)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore each plug-in's state; when one refuses its state (``TypeError`` or
        ``ValueError``), the ones restored before it are put back and the error raised."""
        before = [(plugin, plugin.state_dict()) for plugin in self._stateful]
        try:
            for plugin in self._stateful:
                plugin.load_state_dict(state[plugin.state_key])
        except (TypeError, ValueError):
            for plugin, saved in before:
                plugin.load_state_dict(saved)
            raise

    def _refresh(self) -> None:
        """Re-read what the step hooks compare each step: the next step_end due, and whether
        a device plug-in measures now (one that says ``measuring = False`` costs no call).

        Called after every judged result: read in C (``map`` of an ``attrgetter``), with no
        generator frame per plug-in, and a plug-in without ``measuring`` (always measuring)
        is known at attach (issue 38: the judging's host time a step)."""
        self.next_step = min(map(_NEXT_STEP, self._step_end), default=sys.maxsize)
        self.measures_before = self._always_before or any(map(_MEASURING, self._watch_before))
        self.measures_after = self._always_after or any(map(_MEASURING, self._watch_after))

    def _next_step(self) -> int:
        return min(map(_NEXT_STEP, self._step_end), default=sys.maxsize)
