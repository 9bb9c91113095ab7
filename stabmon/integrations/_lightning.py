"""The Lightning callback's body, free of any Lightning import (both package names share it).

Design
------
Lightning runs the forward and backward pass *inside* ``optimizer.step(closure)``
(except under a GradScaler), so the optimizer's own step pre-hook would see the
previous step's gradients. The adapter therefore gives each Monitor a
:class:`StepMarker`: an optimizer with no update of its own that shares the real
optimizer's parameter groups and state, stepped from ``on_before_optimizer_step``,
which Lightning calls once per optimizer step, after the closure (and after AMP
unscaling) and before gradient clipping. The Monitor measures this step's complete,
unscaled, unclipped gradients there; accumulation batches do not step it. The cost:
the optimizer's own update is timed as part of the next step's input wait.

With several optimizers (manual optimization), each gets a Monitor with run id
``<run id>-opt<i>``. Only the first is attached to the LightningModule itself
(a model carries one Monitor); the others watch a module that shares the
LightningModule's submodules, so they name parameters alike but do not time the
forward pass. The first gets the training loss and the precision plugin's scaler.

Phases: Lightning calls ``training_step``, not the LightningModule itself, so its
forward hooks fire only when ``training_step`` calls ``self(...)``. The adapter marks the
forward pass from ``on_train_batch_start`` (the batch is fetched) and the backward pass
from ``on_before_backward``; without that, the backward was timed as forward.

Throughput: ``on_train_batch_start`` hands the first Monitor the batch's samples (its
leading dimension) and tokens (``input_ids`` of shape (batch, sequence)), read from
the tensors' shapes, never their values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from stabmon.integrations._common import ConfigSource, PhaseSwitch, monitor_settings, restore
from stabmon.monitor import Monitor
from stabmon.pipeline.throughput import batch_samples, batch_tokens
from stabmon.shared.log import LOGGER

__all__ = ["LightningAdapter", "StepMarker"]


class StepMarker(torch.optim.Optimizer):
    """Where a Monitor sees Lightning's optimizer step: same parameters and state, no update."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__(params or [torch.zeros(0, requires_grad=True)], {})
        # The very objects, so add_param_group() and loaded state are seen as they happen.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]  # never takes a closure
        """Does nothing; stepping runs the Monitor's step hooks."""


class _TrainerSave:
    """``on_anomaly``'s checkpoint action for Lightning: ``trainer.save_checkpoint`` into
    ``<default_root_dir>/stabmon-step<N>.ckpt``, before the anomalous step is applied (every
    rank calls it at the same step, as Lightning's save needs). Holds the trainer weakly."""

    def __init__(self, trainer: Any) -> None:
        try:
            self._trainer: Callable[[], Any] = weakref.ref(trainer)
        except TypeError:  # an object without weak references (a stand-in): held as it is
            self._trainer = lambda: trainer

    def __call__(self, step: int) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / f"stabmon-step{step}.ckpt")


def parameter_view(module: torch.nn.Module) -> torch.nn.Module:
    """A module sharing ``module``'s submodules, parameters and buffers under the same names."""
    view = torch.nn.Module()
    for name, child in module.named_children():
        view.add_module(name, child)
    for name, param in module.named_parameters(recurse=False):
        view.register_parameter(name, param)
    for name, buffer in module.named_buffers(recurse=False):
        view.register_buffer(name, buffer)
    return view


class LightningAdapter:
    """Lightning hook methods that drive Monitors; mixed into a ``Callback`` subclass."""

    def __init__(self, config: ConfigSource = None, **overrides: Any) -> None:
        self._config = config
        self._overrides = overrides
        self._monitors: list[Monitor] = []
        self._phases: list[PhaseSwitch] = []
        self._markers: dict[int, StepMarker] = {}
        self._saved: list[Mapping[str, Any]] = []
        self._steps = 0
        self._steps_observed = 0
        self._loss: torch.Tensor | None = None

    @property
    def monitors(self) -> tuple[Monitor, ...]:
        """The attached Monitors, one per optimizer, in the trainer's order (empty when idle)."""
        return tuple(self._monitors)

    # --- lifecycle ------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        """Attach one Monitor per optimizer, then apply a state restored from a checkpoint."""
        self._detach()
        optimizers = list(trainer.optimizers)
        if not optimizers:
            LOGGER.warning("stabmon: the LightningModule has no optimizer; nothing to monitor")
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        try:
            for index, optimizer in enumerate(optimizers):
                marker = StepMarker(optimizer)
                monitor = Monitor(
                    pl_module if index == 0 else parameter_view(pl_module),
                    marker,
                    scaler=scaler if index == 0 else None,
                    config=self._config,
                    **monitor_settings(self._config, self._overrides, index, len(optimizers)),
                )
                # Lightning clips after on_before_optimizer_step, where the marker measured the
                # unclipped gradients: its clip only gives the coefficient of that step.
                monitor._clips_after_measuring()
                if index == 0:  # on_anomaly's checkpoint action: Lightning's own save
                    monitor.on_checkpoint_action(_TrainerSave(trainer))
                self._monitors.append(monitor)
                self._phases.append(PhaseSwitch(monitor))
                self._markers[id(optimizer)] = marker
        except BaseException:
            self._detach()
            raise
        self._restore()

    def on_exception(
        self, trainer: Any, pl_module: torch.nn.Module, exception: BaseException
    ) -> None:
        self._detach()

    def teardown(self, trainer: Any, pl_module: torch.nn.Module, stage: str) -> None:
        """Detach: every hook removed, every thread stopped, the port freed."""
        self._detach()

    def _detach(self) -> None:
        for phase in self._phases:
            phase.close()
        for monitor in self._monitors:
            monitor.detach()
        self._monitors, self._phases, self._markers = [], [], {}
        self._steps = self._steps_observed = 0
        self._loss = None

    # --- steps, loss, epochs ----------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        marker = self._markers.get(id(optimizer)) or self._markers.get(
            id(getattr(optimizer, "optimizer", None))  # a LightningOptimizer wrapper
        )
        if marker is not None:
            marker.step()  # on_anomaly: may raise AnomalyStop, out of trainer.fit()
            self._steps += 1
            monitor = self._monitors[list(self._markers.values()).index(marker)]
            if monitor._held_back():  # skip: Lightning's own step must change nothing either
                for group in marker.param_groups:
                    for param in group["params"]:
                        param.grad = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: torch.nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """The batch is fetched: the forward pass begins (training_step may not call forward)."""
        self._close_phases()
        for monitor in self._monitors:
            monitor.mark_forward()
        if self._monitors:
            monitor = self._monitors[0]
            with monitor.contain():  # an odd batch must not stop training: it goes uncounted
                monitor.observe(samples=batch_samples(batch), tokens=batch_tokens(batch))

    def on_before_backward(
        self, trainer: Any, pl_module: torch.nn.Module, loss: torch.Tensor
    ) -> None:
        """The backward pass begins: timed as ``backward``, not as part of the forward."""
        for monitor in self._monitors:
            monitor.mark_backward()

    def on_train_batch_end(
        self, trainer: Any, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Observe the loss of the step just taken: the sum of its batches' normalized losses."""
        if not self._monitors:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()  # stays on the device; the Monitor reads it back a step later
            self._loss = loss if self._loss is None else self._loss + loss
        if self._steps != self._steps_observed:  # an optimizer stepped during this batch
            self._steps_observed = self._steps
            if self._loss is not None:
                self._monitors[0].observe(loss=self._loss)
            self._loss = None

    def on_train_epoch_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._close_phases()

    def on_train_epoch_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._close_phases()
        for monitor in self._monitors:
            monitor.epoch_end()

    def on_train_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._close_phases()

    # --- phases ---------------------------------------------------------------------------

    def on_validation_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._enter_phases("eval")

    def on_validation_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._close_phases()

    def on_save_checkpoint(
        self, trainer: Any, pl_module: torch.nn.Module, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning writes the file after this hook, and no hook follows the write: the
        # phase stays open until the next event (batch, epoch, validation start or end).
        self._enter_phases("checkpoint")

    def _enter_phases(self, name: str) -> None:
        for phase in self._phases:
            phase.enter(name)

    def _close_phases(self) -> None:
        for phase in self._phases:
            phase.close()

    # --- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The Monitors' states, saved in Lightning's checkpoint under this callback's key."""
        if not self._monitors:
            return {"monitors": list(self._saved)}
        self._enter_phases("checkpoint")  # called first while Lightning builds a checkpoint
        return {"monitors": [monitor.state_dict() for monitor in self._monitors]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's states for the Monitors; applied at fit start, or now if attached."""
        monitors = state_dict.get("monitors") if isinstance(state_dict, Mapping) else None
        if not isinstance(monitors, list):
            LOGGER.warning("stabmon: the checkpoint holds no monitor state; starting over")
            return
        self._saved = [state for state in monitors if isinstance(state, Mapping)]
        self._restore()

    def _restore(self) -> None:
        if not self._monitors or not self._saved:
            return
        for monitor, state in zip(self._monitors, self._saved, strict=False):
            restore(monitor, state, "the Lightning checkpoint")
        self._saved = []
