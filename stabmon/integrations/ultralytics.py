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
  in ``trainer.wdir``. Gradient-norm groups are YOLO's layers (``module_depth`` 2:
  ``model.0`` ... ``model.23``) unless ``module_depth`` is set to something else;
- ``on_train_epoch_start`` and ``on_train_batch_start``: leave any phase (training);
- ``on_train_batch_end``: observe ``trainer.loss`` (kept on the device), and the batch's
  samples: the train loader's batch size, the epoch's last batch as short as the loader
  makes it (the callbacks never see the batch; YOLO counts no tokens);
- ``on_train_epoch_end``: the epoch-end work that follows is phase ``checkpoint``, and
  validation (``on_val_start`` to ``on_val_end``, which the validator runs from the
  trainer's callbacks) is phase ``eval``;
- ``on_model_save``: mark the epoch end, then write the Monitor's state to
  ``trainer.wdir / "stabmon-rank<rank>.pt"``;
- ``on_fit_epoch_end``: leave the phase and mark the epoch end if not saved. Not at
  ``on_train_epoch_end``: when the loss or fitness is NaN, Ultralytics reloads
  ``last.pt`` and repeats the epoch (before saving, and without ``on_fit_epoch_end``),
  and the repeat is the same epoch, not another one;
- ``on_train_end``: leave the phase; training ended normally;
- ``teardown`` (Ultralytics runs it in a ``finally``): detach after a normal end. After
  an exception the Monitor stays attached, so that interpreter exit records the crash
  in the run directory (``exit_status: exception``) instead of a clean detach; call
  :meth:`UltralyticsStabmon.detach` to detach anyway (e.g. to go on in the same process).

See docs/integrations/ultralytics.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from stabmon.config import load_config
from stabmon.integrations._common import (
    ConfigSource,
    EpochBatches,
    PhaseSwitch,
    load_state,
    save_state,
)
from stabmon.monitor import Monitor

__all__ = ["UltralyticsStabmon", "add_stabmon", "state_file"]

_YOLO_MODULE_DEPTH = 2  # model.0 ... model.23 for YOLO11: within max_modules (32)


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
        self._epoch_pending = False  # on_train_epoch_end seen, on_fit_epoch_end not yet
        self._ended = False  # on_train_end seen: teardown follows a normal end
        self._batches: EpochBatches | None = None  # the train loader's, read each epoch
        self._batch_index = 0  # batches of this epoch done

    @property
    def monitor(self) -> Monitor | None:
        """The attached Monitor, or None outside training."""
        return self._monitor

    @property
    def phase(self) -> str | None:
        """The phase held open between events (``eval``, ``checkpoint``), or None in training."""
        return self._phase.name if self._phase is not None else None

    def callbacks(self) -> dict[str, Callable[[Any], None]]:
        """Event name → callback, as Ultralytics' ``add_callback`` takes them."""
        return {
            "on_pretrain_routine_end": self.attach,
            "on_train_start": self.attach,
            "on_train_epoch_start": self.epoch_start,
            "on_train_batch_start": lambda trainer: self._leave(),
            "on_train_batch_end": self.observe_loss,
            "on_train_epoch_end": self.train_epoch_end,
            "on_val_start": lambda validator: self._enter("eval"),
            "on_val_end": lambda validator: self._enter("checkpoint"),
            "on_model_save": self.save,
            "on_fit_epoch_end": self.fit_epoch_end,
            "on_train_end": self.train_end,
            "teardown": self.teardown,
        }

    def attach(self, trainer: Any) -> None:
        """Attach to ``trainer.model`` and ``trainer.optimizer`` (once per training)."""
        if self._monitor is not None:
            return
        scaler = getattr(trainer, "scaler", None)
        enabled = scaler is not None and bool(getattr(scaler, "is_enabled", lambda: False)())
        overrides = dict(self._overrides)
        if (
            "module_depth" not in overrides
            and load_config(self._config, overrides).module_depth == 1
        ):
            # YOLO's layers are all children of one Sequential (`model`): depth 1 is one group.
            overrides["module_depth"] = _YOLO_MODULE_DEPTH
        monitor = Monitor(
            trainer.model,
            trainer.optimizer,
            scaler=scaler if enabled else None,  # a disabled GradScaler never changes its scale
            config=self._config,
            **overrides,
        )
        self._monitor, self._phase = monitor, PhaseSwitch(monitor)
        self._epoch_pending = self._ended = False
        if getattr(trainer, "start_epoch", 0) > 0:  # resume_training() ran before this event
            load_state(monitor, state_file(trainer.wdir, monitor.rank))

    def observe_loss(self, trainer: Any) -> None:
        """``trainer.loss``, this batch's summed loss, handed over without a read-back, and
        the batch's samples."""
        monitor = self._monitor
        if monitor is None:
            return
        loss = getattr(trainer, "loss", None)
        if isinstance(loss, torch.Tensor):
            monitor.observe(loss=loss)
        with monitor.contain():  # an odd loader goes uncounted; training goes on
            if self._batches is None:  # the first batch: the loader is built by now
                self._batches = EpochBatches.of(getattr(trainer, "train_loader", None))
            if self._batches is not None:
                monitor.observe(samples=self._batches.samples(self._batch_index, 1))
        self._batch_index += 1

    def epoch_start(self, trainer: Any) -> None:
        """Training again. An epoch whose end was not confirmed is being repeated (NaN recovery)."""
        self._leave()
        self._epoch_pending = False
        self._batches, self._batch_index = None, 0  # an out-of-memory retry rebuilds the loader

    def train_epoch_end(self, trainer: Any) -> None:
        """The epoch's training is over: validation and saving follow (``checkpoint``, ``eval``)."""
        self._epoch_pending = True
        self._enter("checkpoint")

    def fit_epoch_end(self, trainer: Any) -> None:
        """Leave the phase; the epoch is over and will not be repeated: mark its end."""
        self._leave()
        self._confirm_epoch()

    def train_end(self, trainer: Any) -> None:
        """Training ended normally (Ultralytics does not call this after an exception)."""
        self.fit_epoch_end(trainer)
        self._ended = True

    def teardown(self, trainer: Any) -> None:
        """Detach after a normal end; after an exception, leave the crash to be recorded at exit."""
        if self._ended:
            self.detach()

    def save(self, trainer: Any) -> None:
        """Mark the epoch end, then write the Monitor's state next to the checkpoint just written.

        Ultralytics saves only after its NaN check: a saved epoch is not repeated, and a
        run resumed from this checkpoint starts after it.
        """
        self._confirm_epoch()
        if self._monitor is not None:
            save_state(self._monitor, state_file(trainer.wdir, self._monitor.rank))
        last = getattr(trainer, "last", None)
        if self._phase is not None and self._phase.name == "checkpoint" and last is not None:
            self._phase.close(path=last)  # the save is recorded with last.pt (verdict.json)

    def _confirm_epoch(self) -> None:
        if self._epoch_pending and self._monitor is not None:
            self._monitor.epoch_end()
        self._epoch_pending = False

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        self._leave()
        if self._monitor is not None:
            self._monitor.detach()
        self._monitor, self._phase = None, None
        self._epoch_pending = self._ended = False

    def _enter(self, name: str) -> None:
        if self._phase is not None:
            self._phase.enter(name)

    def _leave(self) -> None:
        if self._phase is not None:
            self._phase.close()
