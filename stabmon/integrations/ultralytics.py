"""``add_stabmon`` for Ultralytics YOLO training, through its callback API.

Example::

    from ultralytics import YOLO
    from stabmon.integrations.ultralytics import add_stabmon

    model = YOLO("yolo11n.yaml")
    add_stabmon(model, run_id="yolo-exp42")
    model.train(data="coco8.yaml", epochs=100, imgsz=640)

``add_stabmon`` takes a ``YOLO`` model or a trainer (anything with
``add_callback(event, fn)``) and registers these callbacks; Ultralytics itself is
never imported:

- ``on_pretrain_routine_end`` (``on_train_start`` if that was missed): attach a
  Monitor to ``trainer.model`` and ``trainer.optimizer``, with ``trainer.scaler``
  when AMP is on; on resume (``trainer.start_epoch > 0``) load the state saved
  in ``trainer.wdir``;
- ``on_train_batch_end``: observe ``trainer.loss`` (kept on the device);
- ``on_train_epoch_end``: mark the epoch end; the epoch-end work that follows is
  phase ``checkpoint``, and validation (``on_val_start`` to ``on_val_end``, which the
  validator runs from the trainer's callbacks) is phase ``eval``;
- ``on_model_save``: write the Monitor's state to ``trainer.wdir / "stabmon-rank<rank>.pt"``;
- ``on_fit_epoch_end`` and ``on_train_end``: leave the phase; ``teardown``: detach.

See docs/integrations/ultralytics.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from stabmon.integrations._common import ConfigSource, PhaseSwitch, load_state, save_state
from stabmon.monitor import Monitor

__all__ = ["UltralyticsStabmon", "add_stabmon", "state_file"]


class _HasCallbacks(Protocol):
    def add_callback(self, event: str, func: Callable[[Any], None]) -> None: ...


def state_file(weights_dir: str | Path, rank: int) -> Path:
    """Where a rank's Monitor state is kept, next to the trainer's ``last.pt``."""
    return Path(weights_dir) / f"stabmon-rank{rank}.pt"


def add_stabmon(
    target: _HasCallbacks, config: ConfigSource = None, **overrides: Any
) -> UltralyticsStabmon:
    """Register stabmon on a YOLO model or trainer; returns the handle holding the Monitor.

    Keyword arguments are those of ``stabmon.attach``: ``config=`` and any config key.
    """
    session = UltralyticsStabmon(config, overrides)
    for event, callback in session.callbacks().items():
        target.add_callback(event, callback)
    return session


class UltralyticsStabmon:
    """The callbacks :func:`add_stabmon` registers, and the Monitor they drive."""

    def __init__(self, config: ConfigSource, overrides: dict[str, Any]) -> None:
        self._config = config
        self._overrides = overrides
        self._monitor: Monitor | None = None
        self._phase: PhaseSwitch | None = None

    @property
    def monitor(self) -> Monitor | None:
        """The attached Monitor, or None outside training."""
        return self._monitor

    def callbacks(self) -> dict[str, Callable[[Any], None]]:
        """Event name → callback, as Ultralytics' ``add_callback`` takes them."""
        return {
            "on_pretrain_routine_end": self.attach,
            "on_train_start": self.attach,
            "on_train_batch_end": self.observe_loss,
            "on_train_epoch_end": self.epoch_end,
            "on_val_start": lambda validator: self._enter("eval"),
            "on_val_end": lambda validator: self._enter("checkpoint"),
            "on_model_save": self.save,
            "on_fit_epoch_end": lambda trainer: self._leave(),
            "on_train_end": lambda trainer: self._leave(),
            "teardown": lambda trainer: self.detach(),
        }

    def attach(self, trainer: Any) -> None:
        """Attach to ``trainer.model`` and ``trainer.optimizer`` (once per training)."""
        if self._monitor is not None:
            return
        scaler = getattr(trainer, "scaler", None)
        enabled = scaler is not None and bool(getattr(scaler, "is_enabled", lambda: False)())
        monitor = Monitor(
            trainer.model,
            trainer.optimizer,
            scaler=scaler if enabled else None,  # a disabled GradScaler never changes its scale
            config=self._config,
            **self._overrides,
        )
        self._monitor, self._phase = monitor, PhaseSwitch(monitor)
        if getattr(trainer, "start_epoch", 0) > 0:  # resume_training() ran before this event
            load_state(monitor, state_file(trainer.wdir, monitor.rank))

    def observe_loss(self, trainer: Any) -> None:
        """``trainer.loss``, this batch's summed loss, handed over without a read-back."""
        loss = getattr(trainer, "loss", None)
        if self._monitor is not None and isinstance(loss, torch.Tensor):
            self._monitor.observe(loss=loss)

    def epoch_end(self, trainer: Any) -> None:
        """Mark the epoch end; validation and saving follow, in phase ``checkpoint`` or ``eval``."""
        if self._monitor is not None:
            self._monitor.epoch_end()
        self._enter("checkpoint")

    def save(self, trainer: Any) -> None:
        """Write the Monitor's state next to the checkpoint Ultralytics has just written."""
        if self._monitor is not None:
            save_state(self._monitor, state_file(trainer.wdir, self._monitor.rank))

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        self._leave()
        if self._monitor is not None:
            self._monitor.detach()
        self._monitor, self._phase = None, None

    def _enter(self, name: str) -> None:
        if self._phase is not None:
            self._phase.enter(name)

    def _leave(self) -> None:
        if self._phase is not None:
            self._phase.close()
