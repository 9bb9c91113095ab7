"""The extension point: the ports every probe and detector plugs into, built-in or the user's.

In the spirit of client_python's ``Collector`` and Lightning's ``Callback``: a plug-in is
one class that implements the hooks it needs, of those below, built once at attach from
the :class:`Context` (what it may call). The built-ins are listed in
:data:`stabmon.wiring.plugins.PLUGINS`; a user passes their own to ``attach(plugins=[...])``. A
factory (usually the class itself) returns None when its feature is configured off. The
Monitor sorts the plug-ins into one tuple per hook, so a hook costs nothing for plug-ins
that do not implement it. Example (a whole plug-in that publishes a metric;
docs/architecture.md, "Adding a probe", has one that measures on the device)::

    class LearningRate:
        component = "exporter"       # its failures count in stabmon_internal_errors_total

        def __init__(self, context: Context) -> None:
            self._optimizer = context.optimizer

        def readings(self) -> Iterable[Reading]:
            groups = self._optimizer.param_groups
            yield LEARNING_RATE, [((str(i),), float(g["lr"])) for i, g in enumerate(groups)]

    mon = stabmon.attach(model, optimizer, plugins=[LearningRate])

The hooks, each optional, each call contained by the guard under ``component``:

- ``measure(step)`` and ``judge(step, values)`` (:class:`MeasuresOnDevice`): the
  device-side port. ``measure`` runs on the training thread at every optimizer step,
  before it (``measure_at = "before_step"``: the gradients are in place; also at the end
  of an iteration whose step GradScaler skipped) or after it (``"after_step"``: the new
  parameters), and returns a small 1-D tensor computed on the
  device, or None when it has nothing to measure at this step. It must never read a value
  back (no ``.item()``, ``.cpu()``, ``.tolist()`` or truth test of a device tensor): the
  tensor is copied back asynchronously with the Monitor's other results and handed to
  ``judge`` as host floats, a step or more later, under the judging lock. A plug-in that
  measures only now and then has a ``measuring`` attribute (or property): while it is
  False ``measure`` is not called (re-read after each measurement, ``grads_judged`` and
  ``loss_judged``), so a disarmed probe costs a step nothing.
- ``grads_judged(step, summary)``: once per measured step's
  :class:`~stabmon.probes.grads.GradSummary`, under the judging lock.
- ``loss_judged(step, value)``: once per training loss observed, as a host float, under
  the judging lock.
- ``clip_judged(step, max_norm)``: the ``max_norm`` of each clip of the model's
  gradients (``clip_grad_norm_``), under the judging lock; the step's pre-clip norms
  come through ``grads_judged``, before or after it.
- ``scale_judged(step, scale)``: the GradScaler's scale after each ``update()`` (a lower
  scale than before means that step was skipped), under the judging lock.
- ``anomaly_recorded(kind, step)``: after any anomaly was counted and written (a built-in's
  or a plug-in's), on the thread that recorded it; for evidence of an incident (the
  batches it trained on). It must not record an anomaly itself.
- ``gate_step(step, optimizer)`` and ``step_applied()`` (:class:`GatesStep`): the training
  thread, in the optimizer's step pre-hook once the gradients were measured (``step`` is
  the index of the step about to be applied), and in its post-hook. A gate may change what
  the step does (hold gradients back, pass the optimizer a device flag, scale the LR) and
  must undo it in ``step_applied``; it may raise :class:`stabmon.AnomalyStop`, the one
  exception the guard lets through (the step is then not applied). While a gate is
  plugged in, ``gate_step`` runs at every optimizer step: what it does there is the cost.
  Built-in: :mod:`stabmon.policies` (``on_anomaly``).
- ``checkpoint_saved(step, path, completed)``: training thread, after a
  ``with mon.phase("checkpoint", path=...)`` block or an adapter's save: the last
  completed step, the path saved to (None when not told) and whether the block ended
  without an exception.
- ``step_end(steps)``: training thread, after an optimizer step, once ``steps`` (steps
  completed in this process) reaches the plug-in's ``next_step``; the Monitor compares
  one integer a step, the smallest ``next_step`` of all, re-read after each call and after
  ``grads_judged`` and ``loss_judged`` (a verdict may ask for the next step end).
- ``epoch_memory(samples)``: training thread, at an epoch boundary, before the epoch's
  record: the memory samples (bytes by device label: ``host``, ``cuda:N``); returns the
  drift against a baseline by label (None while there is none) for that record.
- ``epoch_end(step)``: training thread, at an epoch boundary, after memory was judged.
  ``step`` is the index of the epoch's last step, across resumes, as its ``epoch``
  record names it (docs/steps.md): after ``n`` steps, ``n - 1``; None before the first.
- ``readings()``: the exporter thread, at scrape: ``(contract row, samples)`` pairs,
  each sample ``(label values, value)``; the ``rank`` and ``run`` labels are added.
- ``state_dict()`` / ``load_state_dict(state)`` with ``state_key``: what a checkpoint
  carries (``Monitor.state_dict()`` under ``state_key``), restored on resume. A
  ``load_state_dict`` that raises ``TypeError`` or ``ValueError`` leaves every plug-in as
  it was.
- ``finish()``: under the judging lock at the last judgement (``detach()`` or the
  interpreter's exit): write what is still open (an episode in progress).
- ``detach()``: once, at ``Monitor.detach()``, before the threads stop.

Step numbers are 0-based global step indices across resumes (docs/steps.md). This module
imports nothing from stabmon at run time (a checked leaf): the types below are for
readers and mypy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "AnomalyRecorded",
    "CheckpointSaved",
    "ClipJudged",
    "Context",
    "Detaches",
    "EpochEnd",
    "EpochMemory",
    "Factory",
    "Finishes",
    "GatesStep",
    "GradSummary",
    "GradsJudged",
    "Heartbeat",
    "LossJudged",
    "MeasuresOnDevice",
    "Memory",
    "Plugin",
    "Publishes",
    "Reading",
    "ScaleJudged",
    "Stateful",
    "StepEnd",
]

#: One metric's samples at a scrape: its contract row (a ``stabmon.contract.MetricDef``) and
#: (label values, value) pairs.
Reading = tuple[Any, Iterable[tuple[Sequence[str], float]]]


class GradSummary(Protocol):
    """One measured step's gradients, read back on the host (the Monitor hands a
    ``stabmon.probes.grads.GradSummary``; this module names no stabmon type)."""

    @property
    def total_norm(self) -> float:
        """The global L2 norm, before any clip."""

    @property
    def zero_grad_params(self) -> int:
        """Trainable tensors whose gradient was None or all zero."""

    @property
    def nonfinite(self) -> bool:
        """Whether the total norm is NaN or Inf."""

    @property
    def tensor_norms(self) -> list[float]:
        """Each measured tensor's norm, in the layout's order."""

    @property
    def group_norms(self) -> dict[str, float]:
        """The norm of each module group (the exported ``module`` label)."""

    @property
    def layout(self) -> Any:
        """How to read the norms: parameter names, groups (``stabmon.probes.grads.GradLayout``)."""


class Memory(Protocol):
    """Memory as a plug-in may sample it, in bytes by device label (``host``, ``cuda:N``)."""

    def trend_samples(self) -> dict[str, float]:
        """Bytes now: RSS for host, allocated per CUDA device."""

    def limits(self) -> dict[str, float]:
        """Bytes each label may reach (the cgroup or machine limit; the device's total)."""


class Heartbeat(Protocol):
    """The training loop's progress, as the stall watchdog reads it."""

    @property
    def last_beat(self) -> float:
        """The last progress (a step end, a phase edge), on the loop clock."""

    @property
    def phase(self) -> str:
        """The phase the loop is in (forward, backward, optimizer, data_wait, a named one)."""

    def median_step_seconds(self) -> float | None:
        """The median of the recent steps' durations; None before there are any."""


class Context(Protocol):
    """What a plug-in may use and call, handed to its factory at attach.

    Everything belongs to the Monitor; a plug-in keeps what it needs and nothing refers
    back to the plug-in, so a dropped Monitor is still collected.
    """

    @property
    def config(self) -> Any:
        """The Monitor's ``stabmon.config.Config`` (frozen)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def readings(self) -> Any:
        """What the exporter publishes (``stabmon.pipeline.readings.Readings``): the built-in
        gauges and counters a built-in judge keeps; a plug-in of yours publishes through its
        own ``readings()`` hook instead."""

    @property
    def memory(self) -> Memory: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    @property
    def run_directory(self) -> Path:
        """This rank's run directory (its event log, records and dumps)."""

    @property
    def rank(self) -> int: ...

    @property
    def global_step(self) -> int:
        """Optimizer steps completed, across resumes: the index of the step in progress."""

    @property
    def last_step(self) -> int | None:
        """The index of the last step completed, across resumes; None before the first."""

    def anomaly(self, kind: str, step: int | None, message: str, **details: Any) -> None:
        """Count an anomaly of ``kind`` (a contract kind), write its record and log
        ``message`` (rate-limited). Say where (module, parameter, rank, batch) and what to
        do in ``message``; ``details`` go into the record."""

    def event(self, name: str, **fields: Any) -> None:
        """Write one record to this rank's event log (JSON values only)."""

    def log(self, key: str, level: int, message: str, *args: object) -> None:
        """Log through the Monitor's limiter: at most a few lines a minute per ``key``."""

    def gradient_norms(self) -> torch.Tensor | list[float] | None:
        """The norm of each gradient in place now, before any clip (this step's clip measured
        them before it scaled them): a 1-D device tensor, or host floats for a few CPU
        tensors; None when no gradient is present. Training thread, in ``gate_step`` or a
        ``before_step`` ``measure``; never a sync."""

    def watch_modules(
        self, hook: Callable[[str, Any, Any], None], names: Collection[str] | None = None
    ) -> Callable[[], None]:
        """Call ``hook(module name, inputs, output)`` after every module's forward (the
        unwrapped model's, root included, in completion order), or only those ``names``
        (``""``: the root), until the returned callable is called; call it from the
        training thread. For a few armed steps, not for good: it costs a Python call per
        module watched. ``hook`` must not sync: record device tensors
        and return them from ``measure``. Held weakly; left out of copies and pickles."""

    def watch_gradient(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        """Call ``hook(gradient)`` when autograd computes ``tensor``'s gradient (its total
        over every use); for a tensor of this step's graph, seen by a ``watch_modules``
        hook, so it goes with the graph. ``hook`` returns None, must not raise or sync."""

    def judging(self) -> AbstractContextManager[object]:
        """The judging lock: hold it to call ``anomaly``/``event`` from a thread of your own
        (hooks called by the Monitor under the lock need not take it)."""


#: Builds a plug-in from the Context at attach (or returns None: configured off).
Factory = Callable[[Context], Any]


class Plugin(Protocol):
    """Any plug-in: the guard component its failures are counted against.

    Implement any of the hooks of :mod:`stabmon.extension` (the protocols below); pass the
    class to ``stabmon.attach(model, optimizer, plugins=[MyPlugin])``.
    """

    #: One of stabmon.contract.INTERNAL_COMPONENTS (a bounded label), e.g. "detectors".
    component: str


@runtime_checkable
class MeasuresOnDevice(Protocol):
    component: str
    #: When ``measure`` runs: "before_step" (gradients in place) or "after_step".
    measure_at: Literal["before_step", "after_step"]

    def measure(self, step: int) -> torch.Tensor | None: ...

    def judge(self, step: int, values: list[float]) -> None: ...


@runtime_checkable
class GradsJudged(Protocol):
    component: str

    def grads_judged(self, step: int, summary: GradSummary) -> None: ...


@runtime_checkable
class LossJudged(Protocol):
    component: str

    def loss_judged(self, step: int, value: float) -> None: ...


@runtime_checkable
class ClipJudged(Protocol):
    component: str

    def clip_judged(self, step: int, max_norm: float) -> None: ...


@runtime_checkable
class ScaleJudged(Protocol):
    component: str

    def scale_judged(self, step: int, scale: float) -> None: ...


@runtime_checkable
class AnomalyRecorded(Protocol):
    component: str

    def anomaly_recorded(self, kind: str, step: int | None) -> None: ...


@runtime_checkable
class GatesStep(Protocol):
    component: str

    def gate_step(self, step: int, optimizer: torch.optim.Optimizer) -> None: ...

    def step_applied(self) -> None: ...


@runtime_checkable
class CheckpointSaved(Protocol):
    component: str

    def checkpoint_saved(self, step: int | None, path: str | None, completed: bool) -> None: ...


@runtime_checkable
class StepEnd(Protocol):
    component: str
    #: Steps completed in this process at which step_end next runs.
    next_step: int

    def step_end(self, steps: int) -> None: ...


@runtime_checkable
class EpochMemory(Protocol):
    component: str

    def epoch_memory(self, samples: Mapping[str, float]) -> Mapping[str, float | None]: ...


@runtime_checkable
class EpochEnd(Protocol):
    component: str

    def epoch_end(self, step: int | None) -> None: ...


@runtime_checkable
class Publishes(Protocol):
    component: str

    def readings(self) -> Iterable[Reading]: ...


@runtime_checkable
class Stateful(Protocol):
    component: str
    #: The key of this plug-in's state in Monitor.state_dict() (unique per Monitor).
    state_key: str

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@runtime_checkable
class Finishes(Protocol):
    component: str

    def finish(self) -> None: ...


@runtime_checkable
class Detaches(Protocol):
    component: str

    def detach(self) -> None: ...


#: Reserved state keys (the Monitor's own numbering).
RESERVED_STATE_KEYS: Mapping[str, str] = {
    "version": "the state format",
    "step": "steps completed",
    "epoch": "the epoch in progress",
    "run_id": "the run",
    "epochs_marked_by": "the epoch policy",
}
