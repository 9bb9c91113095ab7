"""A small stand-in for Ultralytics' YOLO model and trainer, for testing add_stabmon.

Ultralytics cannot be installed here (its torchvision does not load against the
CPU torch), so this follows the real callback protocol and attribute names from
ultralytics/ultralytics (ultralytics/engine/trainer.py ``BaseTrainer``,
ultralytics/utils/callbacks/base.py ``default_callbacks``, ultralytics/engine/model.py
``Model.add_callback``), as read in the repository:

- ``Model.add_callback(event, fn)`` appends to ``model.callbacks``; ``Model.train``
  builds the trainer with ``_callbacks=model.callbacks`` (copied per event list);
- ``BaseTrainer``: ``add_callback``, ``run_callbacks(event)`` calling ``fn(trainer)``;
  attributes ``model``, ``optimizer``, ``scaler`` (``torch.amp.GradScaler``, enabled
  with AMP), ``ema`` (a deep copy), ``epoch``, ``start_epoch``, ``epochs``, ``loss``
  (``loss.sum()``), ``tloss``, ``save_dir``, ``wdir``, ``last``;
- ``_setup_train``: model, scaler, optimizer, EMA, ``resume_training``, then
  ``on_pretrain_routine_end``; ``_do_train``: ``on_train_start``, per epoch
  ``on_train_epoch_start``, per batch ``on_train_batch_start``, forward, scaled
  backward, ``optimizer_step()`` every ``accumulate`` batches (``unscale_``,
  ``clip_grad_norm_(max_norm=10)``, ``scaler.step``, ``scaler.update``, ``zero_grad``,
  EMA update), ``on_batch_end``, ``on_train_batch_end``; then ``on_train_epoch_end``,
  ``validate()`` (the validator runs ``on_val_start``/``on_val_end`` from the
  trainer's callbacks), ``save_model()`` + ``on_model_save``, ``on_fit_epoch_end``;
  after the last epoch ``final_eval()``, ``on_train_end``; ``train()`` ends with ``teardown``.

It is a test double of that protocol, not a copy of Ultralytics' code.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Callback = Callable[[Any], None]


class StandInValidator:
    """Runs the trainer's ``on_val_*`` callbacks around a loss over the validation data."""

    def __init__(self, callbacks: dict[str, list[Callback]]) -> None:
        self.callbacks = callbacks  # the trainer's dict, as get_validator passes _callbacks

    def __call__(self, trainer: StandInTrainer) -> dict[str, float]:
        for callback in self.callbacks.get("on_val_start", []):
            callback(self)
        with torch.no_grad():
            loss = trainer.model(trainer.inputs).pow(2).mean()
        for callback in self.callbacks.get("on_val_end", []):
            callback(self)
        return {"fitness": -float(loss)}


class StandInTrainer:
    """BaseTrainer's callback protocol and attribute names over a tiny regression model."""

    def __init__(
        self,
        save_dir: Path,
        *,
        epochs: int = 3,
        batches: int = 8,
        accumulate: int = 2,
        amp: bool = False,
        nan_at: int | None = None,
        resume: bool = False,
        _callbacks: dict[str, list[Callback]] | None = None,
    ) -> None:
        self.callbacks: dict[str, list[Callback]] = defaultdict(list)
        for event, functions in (_callbacks or {}).items():
            self.callbacks[event] = list(functions)
        self.save_dir = save_dir
        self.wdir = save_dir / "weights"
        self.last = self.wdir / "last.pt"
        self.epochs, self.batches, self.accumulate = epochs, batches, accumulate
        self.amp, self.nan_at, self.resume = amp, nan_at, resume
        self.start_epoch = 0
        self.epoch = 0
        self.loss: torch.Tensor | None = None
        self.tloss: dict[str, float] | None = None
        self.clip_norms: list[float] = []  # test-only: clip_grad_norm_'s return, the pre-clip norm
        self.batch_losses: list[float] = []  # test-only

    def add_callback(self, event: str, callback: Callback) -> None:
        self.callbacks[event].append(callback)

    def run_callbacks(self, event: str) -> None:
        for callback in self.callbacks.get(event, []):
            callback(self)

    def train(self) -> None:
        self._do_train()
        self.run_callbacks("teardown")

    def _setup_train(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(4 * self.batches, 8, generator=generator)
        self.scaler = torch.amp.GradScaler("cpu", enabled=self.amp, init_scale=256.0)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.validator = StandInValidator(self.callbacks)
        self.ema = copy.deepcopy(self.model)
        if self.resume:
            self.resume_training(torch.load(self.last, weights_only=False))
        self.run_callbacks("on_pretrain_routine_end")

    def resume_training(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.start_epoch = checkpoint["epoch"] + 1

    def _do_train(self) -> None:
        self._setup_train()
        self.run_callbacks("on_train_start")
        for epoch in range(self.start_epoch, self.epochs):
            self.epoch = epoch
            self.run_callbacks("on_train_epoch_start")
            self.model.train()
            self.tloss = None
            for i, batch in enumerate(self.inputs.split(4)):
                self.run_callbacks("on_train_batch_start")
                ni = i + self.batches * epoch
                with torch.autocast("cpu", dtype=torch.float16, enabled=self.amp):
                    loss = self.model(batch).pow(2).mean().reshape(1) * len(batch)
                    if ni == self.nan_at:
                        loss = loss * float("nan")
                    self.loss = loss.sum()
                self.tloss = {"loss": float(self.loss.detach())}
                self.batch_losses.append(self.tloss["loss"])
                self.scaler.scale(self.loss).backward()
                if (i + 1) % self.accumulate == 0:
                    self.optimizer_step()
                self.run_callbacks("on_batch_end")
                self.run_callbacks("on_train_batch_end")
            self.run_callbacks("on_train_epoch_end")
            self.validator(self)
            self.save_model()
            self.run_callbacks("on_model_save")
            self.run_callbacks("on_fit_epoch_end")
        self.validator(self)  # final_eval
        self.run_callbacks("on_train_end")

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        self.clip_norms.append(
            float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0))
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        with torch.no_grad():  # ModelEMA.update
            for average, current in zip(
                self.ema.parameters(), self.model.parameters(), strict=True
            ):
                average.mul_(0.9).add_(current, alpha=0.1)

    def save_model(self) -> None:
        self.wdir.mkdir(parents=True, exist_ok=True)
        state = {"epoch": self.epoch, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict()}  # fmt: skip
        torch.save(state, self.last)


class StandInYOLO:
    """``ultralytics.YOLO``'s callback surface: ``add_callback`` and ``train(**overrides)``."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = defaultdict(list)
        self.trainer: StandInTrainer | None = None

    def add_callback(self, event: str, callback: Callback) -> None:
        self.callbacks[event].append(callback)

    def train(self, save_dir: Path, **overrides: Any) -> StandInTrainer:
        self.trainer = StandInTrainer(save_dir, _callbacks=self.callbacks, **overrides)
        self.trainer.train()
        return self.trainer
